"""Host-side handle of a vLLM engine for peer reload (``fastsync.reload.PeerReload``).

:class:`VllmReloadEngine` is a :class:`VllmEngine` (same fence: a reload's writes and
generation never overlap; the engine core is paused in the job's pause mode around them, and later
outputs are labelled with the version the reload brought) with the calls ``PeerReload`` makes on joining engines and holders.
"""

from __future__ import annotations

import time
from typing import Any

from fastsync.engines.vllm.handle import VllmEngine

__all__ = ["VllmReloadEngine", "engine_pids"]


class VllmReloadEngine(VllmEngine):
    """``VllmEngine(llm)`` plus ``reload_describe``, ``reload_send``, ``reload_receive``,
    ``load_checkpoint`` and ``digest``; ``name`` names it in reload reports."""

    def __init__(self, llm: Any, *, name: str, rank_offset: int = 0, lock_timeout_s: float = 600.0) -> None:
        super().__init__(llm, rank_offset=rank_offset, lock_timeout_s=lock_timeout_s)
        self.name = name

    def reload_describe(self) -> list[dict]:
        """Every worker's engine tensors, version and whether it holds plain copies."""
        desc = self.describe()
        with self._fenced(f"{self.name}: reload state"):
            states = self._rpc("fastsync_reload_state", what=f"{self.name}: reload state")
        return [{**d, **s} for d, s in zip(desc, states)]

    def reload_send(self, plan_json: str, options: dict) -> list[dict]:
        what = f"holder {self.name}: reload send"
        with self._fenced(what):
            return self._rpc("fastsync_reload_send", plan_json, options, what=what)

    def reload_receive(self, plan_json: str, options: dict) -> list[dict]:
        what = f"joining engine {self.name}: reload receive"
        with self._fenced(what), self._paused(None, what, time.monotonic() + self.lock_timeout_s) as box:
            got = self._rpc("fastsync_reload_receive", plan_json, options, what=what)
            box["flipped"] = True
            return got

    def load_checkpoint(self, model_dir: str, version: int = 0) -> list[dict]:
        what = f"engine {self.name}: load checkpoint {model_dir}"
        with self._fenced(what), self._paused(None, what, time.monotonic() + self.lock_timeout_s) as box:
            got = self._rpc("fastsync_load_checkpoint", model_dir, version, what=what)
            box["flipped"] = True
            return got

    def alive(self) -> bool:
        """False once any of this engine's engine-core processes is gone (killed, crashed)."""
        import psutil  # a vLLM dependency

        for pid in engine_pids(self.llm):
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                return False
        return True

    def digest(self) -> list[dict]:
        with self._fenced(f"{self.name}: digest"):
            return self._rpc("fastsync_digest", what=f"{self.name}: digest")


def engine_pids(llm: Any) -> list[int]:
    """PIDs of a ``vllm.LLM``'s engine-core processes (what a test kills to lose a holder); none
    when the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    if resources is None:
        return []
    mgr = resources.engine_manager
    return [p.pid for p in getattr(mgr, "processes", [])]
