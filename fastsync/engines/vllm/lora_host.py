"""A host handle on a ``vllm.LLM``'s LoRA verbs (``lora.py``), for :class:`fastsync.sync.lora_sync.LoraSync`.

Each method is one ``collective_rpc`` to every worker; a worker's error comes back as its
FastSyncError class (``raise_worker_errors``). :meth:`VllmLoraEngine.request` is the
``LoRARequest`` that names the version the engine serves."""

from __future__ import annotations

from typing import Any

from fastsync.engines.vllm.lora import LORA_ID_BASE, lora_name
from fastsync.host.replies import raise_worker_errors

__all__ = ["VllmLoraEngine"]


class VllmLoraEngine:
    """Example::

        llm = LLM(model=d, enable_lora=True, max_loras=2, max_lora_rank=16, worker_extension_cls=EXTENSION)
        ls = LoraSync(peft_model, control=control, engines=[VllmLoraEngine(llm)], control_port=control.port)
        ls.setup()
        ls.sync(1)                       # after optimizer.step()
        llm.generate(prompts, params, lora_request=ls.engines[0].request())
    """

    def __init__(self, llm: Any, *, rank_offset: int = 0, rpc_timeout_s: float = 600.0) -> None:
        self.llm = llm
        self.rank_offset = rank_offset
        self.rpc_timeout_s = rpc_timeout_s
        self.served = 0
        self.id_base = LORA_ID_BASE

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        got = self.llm.collective_rpc(method, timeout=self.rpc_timeout_s, args=args)
        return raise_worker_errors(got, f"vLLM {method}")

    def lora_describe(self, rank: int) -> list[dict]:
        return self._rpc("fastsync_lora_describe", {"rank": int(rank), "rank_offset": self.rank_offset})

    def lora_connect(self, plan_json: str, options: dict) -> list[dict]:
        self.id_base = int(options.get("lora_id_base", LORA_ID_BASE))
        return self._rpc("fastsync_lora_connect", plan_json, options)

    def lora_begin(self, version: int, timeout_s: float) -> list[dict]:
        return self._rpc("fastsync_lora_begin", int(version), float(timeout_s))

    def lora_finish(self, version: int, timeout_s: float) -> list[dict]:
        got = self._rpc("fastsync_lora_finish", int(version), float(timeout_s))
        self.served = int(version)
        return got

    def lora_compare(self, lora_id: int, other_id: int) -> list[dict]:
        return self._rpc("fastsync_lora_compare", int(lora_id), int(other_id))

    def lora_id(self, version: int | None = None) -> int:
        return self.id_base + (self.served if version is None else int(version))

    def version_of(self, output: Any) -> int | None:
        """The adapter version a finished request ran on, from the ``lora_request`` vLLM's
        ``RequestOutput`` carries (the id of the slot it started on: a request never changes
        slot), or None for a request without a fastsync adapter."""
        req = getattr(output, "lora_request", None)
        version = int(req.lora_int_id) - self.id_base if req is not None else 0
        return version if version > 0 else None

    def request(self, version: int | None = None) -> Any:
        """vLLM's ``LoRARequest`` for ``version`` (default: the one served). Its path is never
        read: the id is registered in the workers' LoRA managers."""
        from vllm.lora.request import LoRARequest

        v = self.served if version is None else int(version)
        if v <= 0:
            from fastsync.errors import SyncError

            raise SyncError("no LoRA version has been synced into this engine yet")
        return LoRARequest(lora_name(v), self.lora_id(v), "/nonexistent/fastsync-in-memory-adapter")
