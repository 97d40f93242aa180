"""Trainer side of a LoRA adapter sync: only the adapter matrices move, every version.

:class:`LoraSync` takes a PEFT model (plain, or FSDP2 with DTensor LoRA matrices). At
:meth:`LoraSync.setup` trainer rank 0 asks every engine rank for its slot layout (recorded from
the engine's own ``set_lora``: ``fastsync.layout.lora``), plans once which box of which PEFT
matrix goes into which engine rank's staging tensor, and connects the engines. Each
:meth:`LoraSync.sync` gathers the matrices (a collective on every trainer rank: adapters are
megabytes), casts them to the engine's LoRA dtype and folds the scaling into B exactly as vLLM does
when it loads an adapter (``B.to(dtype) * (alpha / r)``), writes them from trainer rank 0 into
the engines' staging, and the engines flip the new version into a slot no request uses. A failed
version leaves the previous one serving; every wait has a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fastsync.control import ControlPlane
from fastsync.errors import ConfigError, LayoutError, SyncError
from fastsync.layout.limits import check_bytes
from fastsync.layout.lora import peft_source_name
from fastsync.layout.types import ParamSpec
from fastsync.sync.connect_options import StoreAddress

__all__ = ["LoraSync", "LoraEngineHandle", "LoraSyncResult", "lora_matrices"]


class LoraEngineHandle(Protocol):
    """What LoraSync needs from an engine (``fastsync.engines.vllm.lora_host.VllmLoraEngine``)."""

    def lora_describe(self, rank: int) -> list[dict]: ...

    def lora_connect(self, plan_json: str, options: dict) -> list[dict]: ...

    def lora_begin(self, version: int, timeout_s: float) -> list[dict]: ...

    def lora_finish(self, version: int, timeout_s: float) -> list[dict]: ...

    def request(self, version: int | None = None) -> Any:
        """What a generate call names to run on ``version`` (default: the one served)."""
        ...

    def version_of(self, output: Any) -> int | None:
        """The adapter version a finished request ran on, None without one."""
        ...


@dataclass(slots=True)
class LoraSyncResult:
    version: int
    seconds: float
    bytes_sent: int
    engines: list[list[dict]] = field(default_factory=list)


def lora_matrices(model: torch.nn.Module, adapter: str = "default") -> dict[str, tuple[torch.Tensor, float]]:
    """``{"X.lora_A": (A, 1.0), "X.lora_B": (B, scaling)}`` for every LoRA layer of a PEFT model,
    A/B full (an FSDP2 DTensor is gathered: call on every trainer rank). LayoutError when the
    model has no LoRA matrices of ``adapter``."""
    from torch.distributed.tensor import DTensor

    out: dict[str, tuple[torch.Tensor, float]] = {}
    for name, module in model.named_modules():
        la, lb = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if la is None or lb is None or adapter not in la:
            continue
        scaling = float(module.scaling[adapter])
        for kind, mats, s in (("A", la, 1.0), ("B", lb, scaling)):
            w = mats[adapter].weight
            src = peft_source_name(f"{name}.lora_{kind}.{adapter}.weight", adapter)
            assert src is not None
            full = w.full_tensor() if isinstance(w, DTensor) else w
            out[src] = (full.detach(), s)
    if not out:
        raise LayoutError(f"the trainer model has no LoRA matrices of adapter {adapter!r} (is it a PEFT model?)")
    return out


class LoraSync:
    """Sync a PEFT model's LoRA adapter into live engines' LoRA slots, every step.

    Example::

        model = get_peft_model(base, LoraConfig(r=16, target_modules=[...]))
        ls = LoraSync(model, rank=rank, world_size=world, control=control,
                      engines=[VllmLoraEngine(llm)] if rank == 0 else [], control_port=port)
        ls.setup()                          # once: slot layouts, plan, registration
        for step in range(1, num_steps + 1):
            loss.backward(); optimizer.step()
            ls.sync(step)                   # every trainer rank; rank 0 writes
            # requests now use engines[0].request() (lora id of version `step`)
    """

    def __init__(self, model: torch.nn.Module, *, control: ControlPlane, rank: int = 0, world_size: int = 1,
                 engines: Sequence[LoraEngineHandle] = (), transport: str = "nixl", timeout_s: float = 60.0,
                 adapter: str = "default", control_port: int | None = None, name: str = "lora",
                 max_chunk_bytes: int | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"trainer rank {rank} outside world size {world_size}")
        if engines and rank != 0:
            raise ConfigError(f"engine handles go to trainer rank 0 only (rank {rank} got {len(engines)})")
        if rank == 0 and not engines:
            raise ConfigError("trainer rank 0 needs the engine handles (engines=[...])")
        if not name or "/" in name:
            raise ConfigError(f"name must be a non-empty string without '/', got {name!r}")
        if max_chunk_bytes is not None:
            check_bytes("max_chunk_bytes", max_chunk_bytes)
        self.model, self.rank, self.world_size = model, rank, world_size
        self.control, self.engines, self.transport = control, list(engines), transport
        self.timeout_s, self.adapter, self.name = float(timeout_s), adapter, name
        self.max_chunk_bytes = max_chunk_bytes  # write batches at most this (WeightSender's cap); None: its default
        self.control_port = control_port if control_port is not None else getattr(control, "port", None)
        self.sender: Any = None
        self.plan: Any = None
        self.sources: dict[str, torch.Tensor] = {}
        self.version = 0
        self.engine_info: list[list[dict]] = []

    @property
    def bytes_per_version(self) -> int:
        return sum(t.nbytes for t in self.plan.transfers) if self.plan is not None else 0

    def setup(self) -> None:
        """Slot layouts from every engine rank, the plan, the engines' receivers and this
        rank's sender; LayoutError before any write when trainer and engines disagree."""
        from fastsync.layout.box import full_box
        from fastsync.plan.lora import lora_plan
        from fastsync.layout.types import Shard
        from fastsync.layout.engine_json import engine_tensors_from_json
        from fastsync.sync.sender import WeightSender

        mats = lora_matrices(self.model, self.adapter)
        if self.rank != 0:
            return
        ranks = {int(t.shape[0]) for n, (t, _) in mats.items() if n.endswith(".lora_A")}
        if len(ranks) != 1:
            raise LayoutError(f"the adapter's LoRA ranks differ per module ({sorted(ranks)}): one rank per adapter only")
        r = ranks.pop()
        engine: dict[int, dict] = {}
        dtypes: set[str] = set()
        offset = 0
        self.engine_info = []
        for h in self.engines:
            got = h.lora_describe(r)
            self.engine_info.append(got)
            for w in got:
                engine[offset + int(w["rank"])] = engine_tensors_from_json(w["tensors"])
                dtypes.add(str(w["dtype"]))
            offset += len(got)
        if len(dtypes) != 1:
            raise LayoutError(f"engines hold LoRA stacks of different dtypes {sorted(dtypes)}")
        dtype = dtypes.pop()
        params = {n: ParamSpec(n, tuple(t.shape), dtype) for n, (t, _) in mats.items()}
        plan = lora_plan(params, engine)
        ctl = self.control.with_prefix(f"{getattr(self.control, 'prefix', 'fs')}/{self.name}")
        if self.control_port is None:
            raise ConfigError("LoraSync needs control_port= (the engines' workers join the same control store)")
        options = {**StoreAddress.of(ctl, port=self.control_port), "transport": self.transport,
                   "timeout_s": self.timeout_s}
        self.sources = {n: torch.zeros(p.shape, dtype=getattr(torch, dtype)) for n, p in params.items()}
        plan_json = plan.dumps()
        for h in self.engines:
            h.lora_connect(plan_json, options)
        sender = WeightSender(rank=0, plan=plan, sources=self.sources,
                              shards={n: [Shard(0, full_box(p.shape), 0)] for n, p in params.items()},
                              control=ctl, transport=self.transport, timeout_s=self.timeout_s,
                              max_chunk_bytes=self.max_chunk_bytes)
        try:
            sender.setup()
        except BaseException:
            sender.close()
            raise
        self.sender, self.plan, self._scaling = sender, plan, {n: s for n, (_, s) in mats.items()}

    def sync(self, version: int, *, timeout_s: float | None = None,
             on_chunk: Callable[[int], None] | None = None) -> LoraSyncResult:
        """Every trainer rank (the gather is a collective); trainer rank 0 writes and returns once
        every engine serves ``version``. SyncError when any refused: they keep the previous one.
        ``on_chunk(k)``: called on trainer rank 0 after write batch ``k`` is posted (``WeightSender.sync``)."""
        if version <= self.version:
            raise SyncError(f"trainer rank {self.rank}: LoRA version {version} is not newer than {self.version}")
        t0 = time.perf_counter()
        mats = lora_matrices(self.model, self.adapter)
        if self.rank != 0:
            self.version = version
            return LoraSyncResult(version, time.perf_counter() - t0, 0)
        if self.sender is None:
            raise SyncError("LoraSync.sync() before setup()")
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        with torch.no_grad():
            for n, buf in self.sources.items():
                t, s = mats[n]
                buf.copy_(t)  # the cast vLLM's loader does (tensor.to(lora_dtype))
                if s != 1:
                    buf.mul_(s)  # then LoRALayerWeights.optimize(): lora_b *= scaling, in lora_dtype
        err: BaseException | None = None
        begun = []
        for h in self.engines:
            try:
                h.lora_begin(version, timeout)
                begun.append(h)
            except BaseException as e:
                err = e
                break
        if err is None:
            try:
                self.sender.sync(version, timeout_s=timeout, on_chunk=on_chunk)
            except BaseException as e:
                err = e
        results = []
        for h in begun:  # every begun engine finishes (flips, or rolls back by its deadline)
            try:
                results.append(h.lora_finish(version, timeout))
            except BaseException as e:
                err = err or e
        if err is not None:
            raise err
        self.version = version
        return LoraSyncResult(version, time.perf_counter() - t0, self.bytes_per_version, results)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
