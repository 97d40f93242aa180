"""vLLM worker extension: trainer ranks write new weights straight into a live vLLM engine.

Pass ``worker_extension_cls="fastsync.engines.vllm.FastSyncWorkerExtension"`` to ``vllm.LLM``
(or ``--worker-extension-cls``); every vLLM worker then answers these ``collective_rpc`` calls,
in this order:

1. ``fastsync_describe(options)`` once: read the live model, build this rank's engine tensors from
   the name map (fused ``qkv_proj``, ``gate_up_proj``, MoE ``w13_weight``/``w2_weight``, TP
   slices, replicated norms), check names, local shapes and dtypes against the live parameters
   (``LayoutError`` naming the parameter otherwise) and return them for the planner.
2. ``fastsync_connect(plan_json, options)`` once: build a :class:`WeightReceiver` over the live
   memory, register it with the transport (NIXL by default) and publish its addresses.
3. Per sync: ``fastsync_begin(version)`` then ``fastsync_finish(version, timeout_s)`` (or both in
   ``fastsync_update``). ``finish`` drives the transport until every planned write of the version
   landed (NIXL's UCX progress happens in these polls: without them a one-sided write never
   completes), then runs the post-processing the CPU kernels need, then flips the version.
4. ``fastsync_version()`` any time: the weight version the worker serves (0 = the checkpoint).

Where the bytes land (see ``fastsync.engines.vllm.layout`` for how each kind is detected):
``inplace`` parameters (embedding, norms) are written in their live memory and snapshotted at
``begin`` so a failed sync restores them; prepacked CPU weights (linear layers, fused MoE
experts) cannot be written in place, because the kernels read a packed copy: each gets one
staging tensor (registered once), and at the flip the layer's own post-load step is re-run from
it (``quant_method.process_weights_after_loading`` for linears, ``prepack_moe_weight`` into the
live expert tensors). Those parameters are listed at ``fastsync_describe``, with the reason.

Fence: a ``collective_rpc`` runs inside the engine-core loop, so no forward pass runs while
``fastsync_finish`` (or ``fastsync_update``) is in progress; between ``fastsync_begin`` and
``fastsync_finish`` the host must not schedule generation (``VllmEngine`` in
``fastsync.engines.vllm.host`` keeps both inside one call). Atomicity: a sync that does not
complete (a trainer died, a transfer is missing, the deadline passed) is rolled back: in-place
parameters are restored from their snapshot, prepacked ones were never touched, and the worker
keeps serving the last complete version.

A failed post-processing step (a layer's repack raising) is part of the same rollback: every
layer repacked so far gets its previous packed weights back and the flip is never published.

Errors cross ``collective_rpc`` as ``{"error": [class name, message]}`` results (vLLM would
otherwise turn a worker exception into a dead engine; an exception that is not a FastSyncError
comes back as SyncError naming its type); ``vllm_host`` re-raises them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from typing import Any

import torch

from fastsync.errors import ConfigError, LayoutError, SyncError
from fastsync.engines.vllm import ENGINE
from fastsync.engines.vllm.fallback import Fallback
from fastsync.engines.vllm.rpc_result import call_result as _result
from fastsync.engines.vllm.lora import LoraWorkerMixin
from fastsync.engines.vllm.lora_record import lora_layers_unwrapped
from fastsync.engines.vllm.reload import ReloadWorkerMixin, ensure_staging
from fastsync.engines.vllm.worker_state import (
    EngineDeltaLanding,
    EngineLanding,
    ModuleState,
    StagedEngineLanding,
    WorkerState,
    check_staging_memory,
)
from fastsync.engines.vllm.layout import (
    STAGED_KINDS,
    check_against,
    moe_padding,
    read_live_params,
)
from fastsync.layout.wire import engine_tensors_to_json
from fastsync.sync.connect_options import ConnectOptions
from fastsync.trace.recorder import now_ns

__all__ = ["FastSyncWorkerExtension", "ensure_amx_permission", "EXTENSION"]

log = logging.getLogger(__name__)

#: The value to pass as ``worker_extension_cls``.
EXTENSION = "fastsync.engines.vllm.FastSyncWorkerExtension"

#: Where the worker's engine layout comes from unless ``fastsync_describe(layout=...)`` says.
LAYOUT_ENV = "FASTSYNC_VLLM_LAYOUT"
LAYOUT_MODES = ("auto", "recorded", "hand")


class _Shape:
    """What ``NameMap.validate`` reads of a parameter: its shape."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)


_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158


def ensure_amx_permission() -> bool:
    """Ask Linux for AMX tile state in this process; True when granted or not needed.

    vLLM's CPU attention and GEMM kernels use AMX on CPUs that report it, but Linux (>= 5.16)
    raises SIGILL on the first AMX instruction of a process that did not request the tile state
    with ``arch_prctl(ARCH_REQ_XCOMP_PERM)``. vLLM's workers do not ask (seen here: the worker
    died with exit code -4 at the first ``cpu_attention_with_kv_cache``), so the extension asks
    when its module is imported in the worker, before the first forward pass.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return True
    try:
        if not torch.cpu._is_amx_tile_supported():
            return True
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (AttributeError, OSError):
        return False


ensure_amx_permission()


def _warm_transport() -> float:
    """Initialise NIXL in this worker once (0.0 when done before or NIXL is not installed)."""
    try:
        from fastsync.transport.nixl import warm_up
    except ImportError:
        return 0.0
    return warm_up()


def _config_dict(hf_config: Any) -> dict:
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    if not cfg.get("architectures"):
        cfg["architectures"] = list(getattr(hf_config, "architectures", None) or [])
    return cfg


class FastSyncWorkerExtension(ReloadWorkerMixin, LoraWorkerMixin):
    """Mixed into every vLLM worker by ``worker_extension_cls``; methods are ``collective_rpc``
    targets. All names start with ``fastsync_`` so they never clash with the worker's own."""

    # ---- set-up ---------------------------------------------------------------------------
    def fastsync_describe(self, options: dict | None = None) -> dict:
        """Check the live model against the name map for this rank; return this rank's engine
        tensors (JSON) and which parameters are staged, and why."""
        return _result(lambda: self._fastsync_describe(dict(options or {})))

    def _fastsync_describe(self, options: dict) -> dict:
        # an engine started with enable_lora=True: described (and recorded) as vLLM loaded it
        with lora_layers_unwrapped(self.model_runner.model):  # type: ignore[attr-defined]
            return self._fastsync_describe_model(options)

    def _fastsync_describe_model(self, options: dict) -> dict:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from fastsync import plugins
        from fastsync.layout.engine import engine_tensors_for_rank, vllm_rank_coords
        from fastsync.models.inventory import inventory_from_config

        unknown = set(options) - {"rank_offset", "config", "prepare", "layout"}
        if unknown:
            raise ConfigError(f"fastsync_describe: unknown option(s) {sorted(unknown)}")
        model = self.model_runner.model  # type: ignore[attr-defined]
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        rank = int(options.get("rank_offset", 0)) + int(getattr(self, "rank", tp_rank))
        config = options.get("config") or _config_dict(self.vllm_config.model_config.hf_config)  # type: ignore[attr-defined]
        arch = (config.get("architectures") or ["?"])[0]
        live = read_live_params(model)
        dtypes = {lp.dtype for lp in live.values()}
        dtype = "bfloat16" if "bfloat16" in dtypes else sorted(dtypes)[0]
        name_map, param_shapes, recorded_s = self._fastsync_name_map(model, config, arch, options, tp_size, tp_rank,
                                                                     rank, dtype)
        inventory = None if param_shapes is not None else inventory_from_config(config, name=arch, dtype=dtype)
        # A plugin may describe this engine itself (fastsync_engine_layout); else the name map does.
        expected = plugins.hook().fastsync_engine_layout(engine=model, rank=rank)
        if expected is None:
            pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
            if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
                raise ConfigError("fastsync's vLLM extension does not describe pipeline-parallel engines yet")
            coords = vllm_rank_coords(tp_size=tp_size, tp_rank=tp_rank, dp_size=int(getattr(pc, "data_parallel_size", 1)),
                                      dp_rank=int(getattr(pc, "data_parallel_rank", 0)),
                                      enable_expert_parallel=bool(getattr(pc, "enable_expert_parallel", False)))
            expected = engine_tensors_for_rank(inventory, name_map, dtype=dtype, moe_pad=moe_padding(model), **coords)
        fb = Fallback.of(getattr(self, "_fastsync_recorded", None), dtype, rank) if param_shapes is not None else None
        check_against(live, expected, rank=rank, loaded=fb.loads if fb is not None else ())
        if fb is not None:  # one buffer per fallback tensor: planned and written like any engine tensor
            expected.update(fb.engine_tensors())
        st = WorkerState(rank, tp_rank, tp_size, live, expected)
        old = getattr(self, "_fastsync", None)
        if old is not None:  # describing again keeps the served version and the live receiver
            st.version, st.receiver, st.staging = old.version, old.receiver, old.staging
            st.plain, st.arenas, st.backup_arena = old.plain, old.arenas, old.backup_arena
        if fb is not None:
            fb.adopt(old.fallback if old is not None else None)
        st.fallback = fb
        self._fastsync = st
        prepare_s, agent_s = 0.0, 0.0
        if options.get("prepare", True):
            # what any transfer into or out of this engine needs, paid here (engine start) and
            # once: the staging arena touched, and NIXL/UCX initialised in this worker process
            t0 = time.perf_counter()
            ensure_staging(st)
            agent_s = _warm_transport()
            prepare_s = time.perf_counter() - t0
        staged = {n: f"{lp.kind}: {lp.why}" for n, lp in live.items() if lp.kind in STAGED_KINDS}
        if staged:
            log.info("fastsync: engine rank %d stages %d of %d parameters (prepacked by the CPU kernels, "
                     "repacked at each flip), e.g. %s", rank, len(staged), len(live), next(iter(staged.items())))
        return {
            "rank": rank,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "architecture": arch,
            "engine": ENGINE,
            "tensors": engine_tensors_to_json(expected),
            "staged": staged,
            "inplace": sorted(n for n, lp in live.items() if lp.kind in ("inplace", "inplace_repack")),
            "unused": dict(getattr(name_map, "unused", {}) or {}),
            # the HF parameters the engine's own config implies, with their full shapes: the
            # trainer's must agree (a pieces-only check cannot see a trainer tensor larger than
            # what the engine reads, e.g. an MLP with more rows than the engine's)
            "params": ({n: list(p.shape) for n, p in inventory.params.items()} if inventory is not None
                       else {n: list(shape) for n, shape in (param_shapes or {}).items()}),
            # "recorded": the layout came from running vLLM's own loaders on recording tensors
            "layout": "hand" if param_shapes is None else "recorded",
            "record_s": recorded_s,
            # checkpoint tensors whose loader is not a copy of a box: the operation, the engine
            # parameters vLLM's own load_weights fills from them at each flip
            "fallback": fb.describe() if fb is not None else {},
            # parameters the engine pads (the vocabulary to a multiple of 64, the CPU MoE kernel's
            # intermediate size to a multiple of 32): fastsync writes the logical sub-box, the
            # padding stays as the engine made it
            "padded": {n: {"logical": list(t.logical_shape), "engine": list(t.shape)}
                       for n, t in expected.items() if t.logical_shape is not None},
            "prepare_s": prepare_s,
            "transport_warm_s": agent_s,
        }

    def _fastsync_name_map(self, model: Any, config: dict, arch: str, options: dict, tp_size: int, tp_rank: int,
                           rank: int, dtype: str) -> tuple[Any, dict | None, float]:
        """The hand-written name map, or one recorded from vLLM's own loaders (``layout``
        option, default ``$FASTSYNC_VLLM_LAYOUT`` or ``auto``: hand-written where one exists,
        recorded otherwise; ``recorded``: always record; ``hand``: never). Returns the map, the
        checkpoint's parameter shapes when recorded (None: the hand map's inventory), and the
        seconds the recording took."""
        from fastsync import plugins
        from fastsync.layout.namemap import get_name_map

        mode = options.get("layout") or os.environ.get(LAYOUT_ENV) or "auto"
        if mode not in LAYOUT_MODES:
            raise ConfigError(f"fastsync_describe: layout={mode!r} (option or ${LAYOUT_ENV}) must be one of "
                              f"{LAYOUT_MODES}")
        if mode == "hand":
            return get_name_map(arch, config, engine=ENGINE), None, 0.0
        if mode == "auto":
            nm = plugins.hook().fastsync_name_map(architecture=arch, config=config, engine=ENGINE)
            if nm is not None:
                return get_name_map(arch, config, engine=ENGINE), None, 0.0
        return self._fastsync_record(model, arch, tp_size, tp_rank, rank, dtype)

    def _fastsync_record(self, model: Any, arch: str, tp_size: int, tp_rank: int, rank: int,
                         dtype: str) -> tuple[Any, dict, float]:
        from fastsync.engines.vllm.recorded_map import record_engine_layout, refusal

        t0 = time.perf_counter()
        mc = self.vllm_config.model_config  # type: ignore[attr-defined]
        pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        ep = tp_size * int(getattr(pc, "data_parallel_size", 1)) if getattr(pc, "enable_expert_parallel", False) else 1
        got = record_engine_layout(model, mc.hf_config, model_dir=str(mc.model), architecture=arch, tp_size=tp_size,
                                   tp_rank=tp_rank, ep_size=ep, model_dtype=dtype)
        if got.refused:
            raise refusal(got, rank)
        got.name_map.validate({n: _Shape(s) for n, s in got.params.items() if n not in got.fallback})
        self._fastsync_recorded = got
        log.info("fastsync: engine rank %d recorded its layout from vLLM's loaders: %d engine tensors from %d "
                 "checkpoint tensors (%d fall back) in %.2f s", rank, len(got.name_map.params), len(got.params),
                 len(got.fallback), time.perf_counter() - t0)
        return got.name_map, got.params, time.perf_counter() - t0

    def fastsync_record_layout(self) -> dict:
        """Record this worker's layout from vLLM's own loaders (no bytes move) and return the name
        map as JSON plus what was refused, for tests and tools."""
        def run() -> dict:
            from fastsync.engines.vllm.recorded_map import record_engine_layout
            from fastsync.layout.namemap_wire import name_map_to_json
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            mc = self.vllm_config.model_config  # type: ignore[attr-defined]
            model = self.model_runner.model  # type: ignore[attr-defined]
            arch = (_config_dict(mc.hf_config).get("architectures") or ["?"])[0]
            dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
            t0 = time.perf_counter()
            pc = self.vllm_config.parallel_config  # type: ignore[attr-defined]
            tp = get_tensor_model_parallel_world_size()
            got = record_engine_layout(model, mc.hf_config, model_dir=str(mc.model), architecture=arch,
                                       tp_size=tp, tp_rank=get_tensor_model_parallel_rank(),
                                       ep_size=tp * int(getattr(pc, "data_parallel_size", 1))
                                       if getattr(pc, "enable_expert_parallel", False) else 1,
                                       model_dtype="bfloat16" if "bfloat16" in dtypes else sorted(dtypes)[0])
            return {"name_map": name_map_to_json(got.name_map), "fallback": got.fallback,
                    "loads": {p: list(xs) for p, xs in got.loads.items()}, "refused": got.refused,
                    "params": {n: list(s) for n, s in got.params.items()}, "record_s": time.perf_counter() - t0}
        return _result(run)

    def fastsync_connect(self, plan_json: str, options: dict) -> dict:
        """Build this rank's receiver for ``plan_json`` and register its memory with the transport.
        ``options``: a :class:`~fastsync.sync.connect_options.ConnectOptions` as it crossed
        (``wire()``), checked key by key before anything is built."""
        return _result(lambda: self._fastsync_connect(plan_json, dict(options)))

    def _fastsync_connect(self, plan_json: str, options: dict | ConnectOptions, initial_version: int | None = None,
                          snapshot: bool = True, rank: int | None = None) -> dict:
        from fastsync.sync.receiver import WeightReceiver
        from fastsync.plan.types import Plan

        st = self._fastsync_state()
        rank = st.rank if rank is None else rank  # a peer reload of several engines at once places this one
        opts = options if isinstance(options, ConnectOptions) else ConnectOptions.parse(options)
        if opts.trace:  # WeightSync(trace_dir=...): finish() returns this rank's phases ("sync")
            from fastsync.trace import enable

            enable()
        last_attempted = st.version if initial_version is None else initial_version
        if st.receiver is not None:
            old, st.receiver = st.receiver, None  # never left pointing at a closed receiver
            if initial_version is None:
                last_attempted = max(last_attempted, old.versions.attempted)  # a failed version stays spent
            old.close()
        plan = Plan.loads(plan_json)
        t0 = time.perf_counter()
        dest: dict[str, torch.Tensor] = {}
        backup: list[str] = []
        ensure_staging(st)  # one touched arena for every prepacked parameter
        fb = st.fallback
        if fb is not None:
            fb.allocate(st.live)
        for name, t in st.expected.items():
            if fb is not None and name in fb.buffers:  # written whole; vLLM's loader reads it at the flip
                dest[name] = fb.buffers[name]
                continue
            lp = st.live[name]
            if lp.kind in STAGED_KINDS:
                dest[name] = st.staging[name]
            else:
                dest[name] = lp.live
                backup.append(name)
        def post() -> None:
            s = self._fastsync_state()
            if s.fallback is not None:
                self._fastsync_fallback_load(s)
            self._fastsync_postprocess(s)

        kw: dict[str, Any] = dict(
            rank=rank, plan=plan, tensors=dest, control=opts.control(),
            transport=opts.transport, transport_options=opts.transport_options,
            timeout_s=opts.timeout_s, verify=opts.verify,
            initial_version=st.version if initial_version is None else initial_version,
        )
        rx: Any
        staged = opts.staged
        if staged:
            check_staging_memory(st, dest, backup)
        if staged:  # writes land off the live model: the engine keeps generating until the flip
            landing: EngineLanding = StagedEngineLanding(dest, backup, on_apply=post, arena=st.backup_arena)
            rx = WeightReceiver(landing=landing, **kw)
        elif opts.delta:  # WeightSync(delta=True): deltas land in the same memory, same fence
            from fastsync.sync.delta_receiver import DeltaReceiver, inbox_sizes

            landing = EngineDeltaLanding(dest, backup if snapshot else [], post,
                                                        inbox_sizes(plan, rank), arena=st.backup_arena)
            rx = DeltaReceiver(landing=landing, **kw)
        else:
            landing = EngineLanding(dest, backup if snapshot else [], on_apply=post, arena=st.backup_arena)
            rx = WeightReceiver(landing=landing, **kw)
        # the snapshot arena outlives receivers (a reload or a new trainer set-up connects again):
        # allocated and touched once per worker, not per connect
        if snapshot:
            st.backup_arena = landing._backup_arena
        rx.versions.attempted = last_attempted
        try:
            rx.setup()
        except BaseException:
            try:  # release the transport agent and registered memory of the half-set-up receiver
                rx.close()
            except Exception as e:  # the setup error is the one to report
                log.warning("fastsync: closing the half-set-up receiver of rank %d failed: %s: %s",
                            rank, type(e).__name__, e)
            raise
        st.receiver = rx
        st.staged = staged
        return {
            "rank": rank,
            "transport": rx.transport.name,
            "staged": staged,
            "setup_s": time.perf_counter() - t0,
            "staged_bytes": sum(b.numel() * b.element_size() for b in st.staging.values()),
            "inplace_bytes": sum(dest[n].numel() * dest[n].element_size() for n in backup),
        }

    # ---- one sync -------------------------------------------------------------------------
    def fastsync_begin(self, version: int) -> dict:
        """Open ``version``: snapshot in-place parameters, arm the transport, tell the trainers to
        write. The host must not generate until ``fastsync_finish`` returns."""
        return _result(lambda: self._fastsync_begin(int(version)))

    def _fastsync_begin(self, version: int) -> dict:
        st = self._fastsync_state(connected=True)
        st.receiver.begin_as_chosen(version)  # dense, or delta as trainer rank 0 chose for this version
        st.open = version
        return {"rank": st.rank, "version": version}

    def fastsync_finish(self, version: int, timeout_s: float = 60.0) -> dict:
        """Wait (driving the transport) until ``version`` landed, post-process, flip. On failure
        roll back and report the error; the worker keeps serving its last complete version."""
        return _result(lambda: self._fastsync_finish(int(version), float(timeout_s)))

    def _fastsync_finish(self, version: int, timeout_s: float, waited: bool = False) -> dict:
        st = self._fastsync_state(connected=True)
        if st.open != version:
            raise SyncError(f"engine rank {st.rank}: finish({version}) but the open version is {st.open}")
        rx = st.receiver
        t0 = time.perf_counter()
        st.undo, st.postprocess_s, st.fallback_s = [], 0.0, 0.0
        try:
            if not waited:  # (staged: the background thread already drove the receive)
                rx.wait(time.monotonic() + timeout_s)
            t_wait = time.perf_counter() - t0
            # verifies, then EngineLanding.apply runs the post-processing, then the flip is
            # published; raises SyncError (after rolling back) when incomplete or post-processing failed
            rx.finish()
        except BaseException as e:
            st.open = None
            if rx.version == version:  # flipped and published; a step after the flip raised
                st.version, st.undo = version, []
                raise
            for saved in reversed(st.undo):  # layers repacked before the failure get their old state back
                saved.restore()
            st.undo = []
            rx.abort(f"{type(e).__name__}: {e}")  # no-op when finish() already rolled back
            raise
        st.undo = []  # the flip is final: the previous packed weights can go
        st.version, st.open, st.plain = version, None, True
        total = time.perf_counter() - t0
        st.last = {"rank": st.rank, "version": version, "wait_s": t_wait,
                   "finish_s": total - t_wait - st.postprocess_s - st.fallback_s, "postprocess_s": st.postprocess_s,
                   "fallback_s": st.fallback_s, "total_s": total,
                   "landed_s": getattr(rx.transport, "landed_s", None),  # NIXL: own bytes in (relays may go on)
                   # what went through vLLM's load_weights instead of straight into the live weights
                   "fallback": st.fallback.volume() if st.fallback is not None else {"tensors": 0, "bytes": 0},
                   # this version's in-protocol check before the flip (WeightSync(verify=...)): mode, seconds, ok
                   "verify": dict(rx.last_verify) if rx.verify else {"mode": "off"}}
        m = rx.last_metrics
        if m is not None and m.spans is not None:  # tracing: the phases, the repack inside "apply"
            apply_thread = next((s["thread"] for s in m.spans if s["name"] == "apply"), "repack")
            repack = [{"name": "repack", "ts_ns": st.postprocess_ns, "dur_ns": int(st.postprocess_s * 1e9),
                       "thread": apply_thread}] if st.postprocess_ns else []
            st.last["sync"] = {**m.to_json(), "spans": m.spans + repack}
        return st.last

    # ---- staged receive: generation goes on, the pause is only the flip ---------------------
    def fastsync_stage(self, version: int, timeout_s: float = 60.0) -> dict:
        """Open ``version`` and receive it on a background thread of this worker (the writes land
        in staging and shadow memory, off the live model): returns at once, and the engine keeps
        generating on its version. Then ``fastsync_stage_ready`` until done, then ``fastsync_flip``."""
        return _result(lambda: self._fastsync_stage(int(version), float(timeout_s)))

    def _fastsync_stage(self, version: int, timeout_s: float) -> dict:
        import threading

        st = self._fastsync_state(connected=True)
        if not st.staged:
            raise SyncError(f"engine rank {st.rank}: fastsync_stage needs fastsync_connect(..., staged=True)")
        got = self._fastsync_begin(version)
        rx, deadline = st.receiver, time.monotonic() + timeout_s
        box: list = []

        def receive() -> None:  # the only thread that touches the transport until the flip
            try:
                box.append(rx.wait(deadline))
            except BaseException as e:  # noqa: BLE001 - the flip reports it
                box.append(e)

        st.stage_thread = (threading.Thread(target=receive, name=f"fastsync-stage-{version}", daemon=True), box,
                           time.perf_counter())
        st.stage_thread[0].start()
        return got

    def fastsync_stage_ready(self, version: int) -> dict:
        """Whether the staged receive of ``version`` ended (all landed, or it failed/ran out of time)."""
        def run() -> dict:
            st = self._fastsync_state(connected=True)
            if st.open != int(version) or st.stage_thread is None:
                raise SyncError(f"engine rank {st.rank}: no staged version {version} is open (open: {st.open})")
            return {"rank": st.rank, "done": not st.stage_thread[0].is_alive()}
        return _result(run)

    def fastsync_flip(self, version: int, timeout_s: float = 10.0) -> dict:
        """Inside the pause: end the staged receive (bounded), then verify, copy the shadows in,
        post-process and flip, or roll back and keep the served version."""
        return _result(lambda: self._fastsync_flip(int(version), float(timeout_s)))

    def _fastsync_flip(self, version: int, timeout_s: float) -> dict:
        st = self._fastsync_state(connected=True)
        if st.open != version or st.stage_thread is None:
            raise SyncError(f"engine rank {st.rank}: flip({version}) but no staged version {version} is open "
                            f"(open: {st.open})")
        th, box, t_start = st.stage_thread
        th.join(timeout_s)
        if th.is_alive():  # still receiving: fail it by its deadline (finish() sees it incomplete)
            st.receiver.expire()
            th.join(5.0)
        st.stage_thread = None
        received_s = time.perf_counter() - t_start
        t0 = time.perf_counter()
        got = self._fastsync_finish(version, 0.0, waited=True)
        return {**got, "received_s": received_s, "flip_s": time.perf_counter() - t0}

    def fastsync_update(self, version: int, timeout_s: float = 60.0) -> dict:
        """``fastsync_begin`` and ``fastsync_finish`` in one call (the engine stays fenced)."""
        got = self.fastsync_begin(version)
        if "error" in got:
            return got
        return self.fastsync_finish(version, timeout_s)

    def fastsync_version(self) -> int:
        """The weight version this worker serves (0 until the first complete sync)."""
        st = getattr(self, "_fastsync", None)
        return 0 if st is None else st.version

    def fastsync_close(self) -> bool:
        st = getattr(self, "_fastsync", None)
        if st is not None and st.receiver is not None:
            st.receiver.close()
            st.receiver = None
        return True

    # ---- helpers --------------------------------------------------------------------------
    def _fastsync_state(self, connected: bool = False) -> WorkerState:
        st = getattr(self, "_fastsync", None)
        if st is None:
            raise SyncError("fastsync worker extension: fastsync_describe() has not run on this worker")
        if connected and st.receiver is None:
            raise SyncError(f"engine rank {st.rank}: fastsync_connect() has not run on this worker")
        return st

    def _fastsync_fallback_load(self, st: WorkerState) -> None:
        """The fallback tensors through vLLM's own ``load_weights`` (``fallback.py``), inside the
        flip and before the repack; the in-place parameters it writes are snapshotted onto
        ``st.undo``, so a failure here or later puts them back with the repacked layers."""
        t0 = time.perf_counter()
        try:
            with lora_layers_unwrapped(self.model_runner.model) as model:  # type: ignore[attr-defined]
                st.fallback.load(model, st.live, st.staging, st.undo)
        except Exception as e:
            for saved in reversed(st.undo):
                saved.restore()
            st.undo = []
            if isinstance(e, SyncError):
                raise SyncError(f"engine rank {st.rank}: {e}; every parameter keeps version {st.version}") from e
            raise SyncError(f"engine rank {st.rank}: the fallback load failed ({type(e).__name__}: {e}); every "
                            f"parameter keeps version {st.version}") from e
        finally:
            st.fallback_s = time.perf_counter() - t0

    def _fastsync_postprocess(self, st: WorkerState) -> None:
        """Re-run exactly the post-load steps the CPU kernels read from, on the new values.

        Runs inside ``WeightReceiver.finish`` before the flip is published. Each layer's state is
        saved (``st.undo``) before its step, and the new packed weights are built beside the old
        ones, so a failure at any layer puts every layer back as it was (the previous packed
        weights stay alive until the flip is final: transiently one more copy of them) and is
        reported as SyncError, which makes the receiver roll back and keep the old version."""
        st.postprocess_ns = now_ns()
        t0 = time.perf_counter()
        name = ""
        try:
            for name, lp in st.live.items():
                if lp.kind == "linear_repack":
                    st.undo.append(ModuleState(lp.module))
                    # UnquantizedLinearMethod on CPU: dispatch_cpu_unquantized_gemm(remove_weight=True)
                    # packs a copy (sgl VNNI or a oneDNN handle) and empties the parameter again.
                    lp.module.weight = torch.nn.Parameter(st.staging[name], requires_grad=False)
                    lp.module.quant_method.process_weights_after_loading(lp.module)
                elif lp.kind == "inplace_repack":
                    for module in (lp.module, *lp.tied):  # a tied LM head keeps its own packed copy
                        st.undo.append(ModuleState(module))
                        module.quant_method.process_weights_after_loading(module)
                elif lp.kind == "moe_repack":
                    experts = lp.module.quant_method.moe_kernel.fused_experts
                    param = getattr(lp.module, lp.attr)
                    src = st.staging[name]
                    if tuple(src.shape) != lp.shape or tuple(param.data.shape) != lp.shape:
                        # the native packer trusts its shapes: a mismatch would write out of bounds
                        raise LayoutError(f"staging {tuple(src.shape)} / parameter {tuple(param.data.shape)} "
                                          f"differ from the engine shape {lp.shape}")
                    packed = torch.empty_like(src)
                    torch.ops._C.prepack_moe_weight(src, packed, experts.isa)
                    st.undo.append(ModuleState(lp.module))
                    param.data = packed  # the kernel reads the layer's parameter at each forward
        except Exception as e:
            for saved in reversed(st.undo):
                saved.restore()
            st.undo = []
            raise SyncError(f"engine rank {st.rank}: post-processing engine parameter {name!r} failed "
                            f"({type(e).__name__}: {e}); every layer keeps version {st.version}") from e
        finally:
            st.postprocess_s = time.perf_counter() - t0
