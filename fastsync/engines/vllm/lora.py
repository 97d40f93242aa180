"""The vLLM worker's LoRA verbs: adapter versions land off the serving slot, then one flip.

``collective_rpc`` targets, in order (``fastsync.engines.vllm.lora_host.VllmLoraEngine`` calls
them, ``fastsync.sync.lora_sync.LoraSync`` drives it):

1. ``fastsync_lora_describe({"rank": r})`` once: record this engine rank's slot layout from
   vLLM's own ``set_lora`` (``lora_record.py``) and return its staging tensors for the planner.
2. ``fastsync_lora_connect(plan_json, options)`` once: allocate the staging tensors (one slot's
   written regions), a :class:`WeightReceiver` over them, registered with the transport.
3. Per adapter version: ``fastsync_lora_begin(v)`` (arm the receiver; generation goes on, the
   staging is not read by any forward), then ``fastsync_lora_finish(v, timeout_s)``: wait, with a
   deadline, until every write landed, then, inside this call (the engine-core loop runs no
   forward meanwhile), copy the staging into a slot no request uses, register that slot under
   lora id ``base + v`` and retire the version before the serving one. A failure anywhere leaves
   the serving version's id and slot untouched.

Requests name the version with ``LoRARequest(f"fastsync-lora-v{v}", base + v, <any path>)``:
vLLM finds the id registered and active and loads nothing. Two slots alternate (``max_loras``
must leave two free for fastsync); a request still on version ``v - 2`` when ``v`` lands would
make vLLM try to load that id from its path, so hosts hand out only the current version's request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fastsync.engines.vllm.lora_record import SlotRegion, lora_manager, record_lora_layout
from fastsync.engines.vllm.rpc_result import call_result as _result
from fastsync.errors import ConfigError, SyncError
from fastsync.layout.types import EngineTensor
from fastsync.sync.connect_options import StoreAddress

__all__ = ["LoraWorkerMixin", "LoraConnectOptions", "LORA_ID_BASE", "lora_name"]

#: fastsync's adapter versions use lora ids ``LORA_ID_BASE + version``, clear of a user's own ids.
LORA_ID_BASE = 1_000_000


def lora_name(version: int) -> str:
    return f"fastsync-lora-v{version}"


@dataclass(frozen=True, kw_only=True)
class LoraConnectOptions(StoreAddress):
    """``fastsync_lora_connect``: where the control store is, the transport and the deadline."""

    transport: str = "nixl"
    timeout_s: float = 60.0
    lora_id_base: int = LORA_ID_BASE

    call: ClassVar[str] = "fastsync_lora_connect"


@dataclass
class LoraState:
    """What a worker keeps between LoRA calls."""

    rank: int
    tensors: dict[str, EngineTensor]
    regions: list[SlotRegion]
    lora_rank: int
    staging: dict[str, torch.Tensor] = field(default_factory=dict)
    receiver: Any = None
    id_base: int = LORA_ID_BASE
    open: int | None = None
    serving: tuple[int, int] | None = None  # (version, slot)
    retired: list[tuple[int, int]] = field(default_factory=list)  # older versions still registered
    last: dict = field(default_factory=dict)
    thread: Any = None  # the open version's background receive
    error: BaseException | None = None  # how that receive failed (it rolled the version back already)


class LoraWorkerMixin:
    """Mixed into ``FastSyncWorkerExtension``; every method a ``collective_rpc`` target."""

    def fastsync_lora_describe(self, options: dict | None = None) -> dict:
        """Record this rank's slot layout for an adapter of rank ``options["rank"]``."""
        return _result(lambda: self._fastsync_lora_describe(dict(options or {})))

    def _fastsync_lora_describe(self, options: dict) -> dict:
        from vllm.distributed import get_tensor_model_parallel_rank

        from fastsync.layout.engine_json import engine_tensors_to_json

        unknown = set(options) - {"rank", "rank_offset"}
        if unknown or "rank" not in options:
            raise ConfigError(f"fastsync_lora_describe: options need 'rank' (got unknown {sorted(unknown)})")
        mgr = lora_manager(self)
        t0 = time.perf_counter()
        tensors, regions = record_lora_layout(mgr, int(options["rank"]))
        rank = int(options.get("rank_offset", 0)) + int(get_tensor_model_parallel_rank())
        old = getattr(self, "_fastsync_lora", None)
        if old is not None and old.receiver is not None:
            old.receiver.close()
        st = LoraState(rank, tensors, regions, int(options["rank"]))
        if old is not None:  # describing again (a new adapter rank) keeps the versions registered so far
            st.serving, st.retired, st.id_base = old.serving, old.retired, old.id_base
        self._fastsync_lora = st
        return {"rank": rank, "tensors": engine_tensors_to_json(tensors), "record_s": time.perf_counter() - t0,
                "max_loras": int(mgr.lora_slots), "dtype": str(mgr.lora_config.lora_dtype).removeprefix("torch.")}

    def fastsync_lora_connect(self, plan_json: str, options: dict) -> dict:
        return _result(lambda: self._fastsync_lora_connect(plan_json, options))

    def _fastsync_lora_connect(self, plan_json: str, options: dict) -> dict:
        from fastsync.plan.types import Plan
        from fastsync.sync.receiver import WeightReceiver

        st = self._fastsync_lora_state()
        opts = LoraConnectOptions.parse(options)
        plan = Plan.loads(plan_json)
        st.staging = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for n, t in st.tensors.items()}
        rx = WeightReceiver(rank=st.rank, plan=plan, tensors=st.staging, control=opts.control(),
                            transport=opts.transport, mode="inplace", timeout_s=opts.timeout_s,
                            initial_version=st.serving[0] if st.serving else 0)
        try:
            rx.setup()
        except BaseException:
            rx.close()
            raise
        st.receiver, st.id_base = rx, opts.lora_id_base
        return {"rank": st.rank, "staging_bytes": sum(t.numel() * t.element_size() for t in st.staging.values())}

    def fastsync_lora_begin(self, version: int, timeout_s: float = 60.0) -> dict:
        """Arm ``version`` and receive it on a background thread (the only one touching the
        transport until finish); returns at once and the engine goes on generating."""
        return _result(lambda: self._fastsync_lora_begin(int(version), float(timeout_s)))

    def _fastsync_lora_begin(self, version: int, timeout_s: float) -> dict:
        import threading

        st = self._fastsync_lora_state(connected=True)
        if st.open is not None:
            raise SyncError(f"engine rank {st.rank}: LoRA version {version} begun while {st.open} is open")
        rx = st.receiver
        rx.begin(version)
        st.open, st.error, deadline = version, None, time.monotonic() + timeout_s

        def receive() -> None:
            try:
                rx.wait(deadline)
            except BaseException as e:  # noqa: BLE001 - e.g. the trainer died: finish raises it
                st.error = e

        st.thread = threading.Thread(target=receive, name=f"fastsync-lora-{version}", daemon=True)
        st.thread.start()
        return {"rank": st.rank, "version": version}

    def fastsync_lora_finish(self, version: int, timeout_s: float = 60.0) -> dict:
        return _result(lambda: self._fastsync_lora_finish(int(version), float(timeout_s)))

    def _fastsync_lora_finish(self, version: int, timeout_s: float) -> dict:
        st = self._fastsync_lora_state(connected=True)
        if st.open != version:
            raise SyncError(f"engine rank {st.rank}: LoRA finish({version}) but the open version is {st.open}")
        rx, t0 = st.receiver, time.perf_counter()
        st.open = None
        try:
            if st.thread is not None:
                st.thread.join(timeout_s)
                if st.thread.is_alive():  # still receiving at the deadline: end its wait, finish sees it incomplete
                    rx.expire()
                    st.thread.join(5.0)
                st.thread = None
            if st.error is not None:  # the receive failed and rolled back: its reason, not "no version open"
                err, st.error = st.error, None
                raise err
            rx.finish()  # raises SyncError naming what is missing when incomplete
        except BaseException as e:
            rx.abort(f"{type(e).__name__}: {e}")
            raise
        t_wait = time.perf_counter() - t0
        t1 = time.perf_counter()
        slot = self._fastsync_lora_flip(st, version)
        st.last = {"rank": st.rank, "version": version, "slot": slot, "lora_id": st.id_base + version,
                   "wait_s": t_wait, "flip_s": time.perf_counter() - t1}
        return st.last

    def _fastsync_lora_flip(self, st: LoraState, version: int) -> int:
        """Staging into a slot no request uses, then that slot serves ``id_base + version``.
        Everything before the last three assignments touches only the spare slot."""
        from vllm.lora.lora_model import LoRAModel

        mgr = lora_manager(self)
        new_id = st.id_base + version
        free = [i for i, lid in enumerate(mgr.lora_index_to_id) if lid is None]
        if st.retired:  # fastsync holds two slots at most: the serving version's and this one
            old_v, slot = st.retired.pop(0)
            mgr.remove_adapter(st.id_base + old_v)  # unpins, deactivates, frees the slot
        elif free:
            slot = free[0]
        else:
            raise SyncError(f"engine rank {st.rank}: no LoRA slot free for version {version} (max_loras "
                            f"{mgr.lora_slots}, used by ids {mgr.lora_index_to_id}); start the engine with "
                            f"max_loras >= 2 more than your own adapters")
        for module in mgr.modules.values():
            module.reset_lora(slot)
        for r in st.regions:
            stack = getattr(mgr.modules[r.module], f"lora_{r.kind}_stacked")[r.index]
            stack[slot, 0, : r.rows, : r.cols].copy_(st.staging[r.name])
        mgr._registered_adapters[new_id] = LoRAModel(new_id, st.lora_rank, {})
        mgr._registered_adapters.pin(new_id)
        mgr._active_adapters[new_id] = None
        mgr._active_adapters.pin(new_id)
        mgr.lora_index_to_id[slot] = new_id
        if st.serving is not None:
            st.retired.append(st.serving)
        st.serving = (version, slot)
        return slot

    def fastsync_lora_compare(self, lora_id: int, other_id: int) -> dict:
        """Whether the slots of ``lora_id`` and ``other_id`` hold the same bytes in every linear
        LoRA layer's stacks (e.g. a fastsync version against vLLM's own load of the same adapter)."""
        def run() -> dict:
            mgr = lora_manager(self)
            ids = list(mgr.lora_index_to_id)
            for i in (lora_id, other_id):
                if i not in ids:
                    raise SyncError(f"lora id {i} holds no slot (slots: {ids})")
            a, b = ids.index(lora_id), ids.index(other_id)
            n, diff = 0, []
            from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

            for name, module in mgr.modules.items():
                if not isinstance(module, BaseLinearLayerWithLoRA):
                    continue  # the layers fastsync syncs (lora_record.py)
                for kind in ("a", "b"):
                    for i, stack in enumerate(getattr(module, f"lora_{kind}_stacked", ())):
                        n += 1
                        if not torch.equal(stack[a], stack[b]):
                            diff.append(f"{name}.lora_{kind}.{i}")
            return {"equal": not diff, "tensors": n, "differ": diff[:5], "num_differ": len(diff)}
        return _result(run)

    def _fastsync_lora_state(self, connected: bool = False) -> LoraState:
        st = getattr(self, "_fastsync_lora", None)
        if st is None:
            raise SyncError("fastsync_lora_describe() has not run on this worker")
        if connected and st.receiver is None:
            raise SyncError(f"engine rank {st.rank}: fastsync_lora_connect() has not run on this worker")
        return st

