"""What a vLLM worker says about itself before anything moves: its engine tensors, checked
against the live parameters, from the hand-written name map or recorded from vLLM's own loaders.

Called by the worker extension's ``fastsync_describe`` / ``fastsync_record_layout`` verbs and by
vLLM's weight-transfer backend's ``init_transfer_engine``; the :class:`WorkerState` it builds is
what :class:`~fastsync.engines.vllm.binding.VllmBinding` binds an engine session to.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from fastsync.engines.vllm import ENGINE
from fastsync.engines.vllm.fallback import Fallback
from fastsync.engines.vllm.layout import STAGED_KINDS, check_against, moe_padding, read_live_params
from fastsync.engines.vllm.lora_record import lora_layers_unwrapped
from fastsync.engines.vllm.reload import ensure_staging
from fastsync.engines.vllm.worker_state import WorkerState
from fastsync.errors import ConfigError
from fastsync.layout.engine_json import engine_tensors_to_json

__all__ = ["LAYOUT_ENV", "LAYOUT_MODES", "describe_worker", "record_layout"]

log = logging.getLogger(__name__)

#: Where the worker's engine layout comes from unless ``fastsync_describe(layout=...)`` says.
LAYOUT_ENV = "FASTSYNC_VLLM_LAYOUT"
LAYOUT_MODES = ("auto", "recorded", "hand")


class _Shape:
    """What ``NameMap.validate`` reads of a parameter: its shape."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)


def _warm_transport() -> float:
    """Initialise NIXL in this worker once (0.0 when done before or NIXL is not installed)."""
    try:
        from fastsync.transport.nixl import warm_up
    except ImportError:
        return 0.0
    return warm_up()


def config_dict(hf_config: Any) -> dict:
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    if not cfg.get("architectures"):
        cfg["architectures"] = list(getattr(hf_config, "architectures", None) or [])
    return cfg


def describe_worker(model: torch.nn.Module, vllm_config: Any, worker_rank: int | None, options: dict,
                    old: WorkerState | None) -> tuple[dict, WorkerState]:
    """Check the live model against the name map for this rank; return this rank's engine
    tensors (JSON) and which parameters are staged, and why, with the worker's new state
    (``old``'s staging memory, plain copy and fallback buffers carried over)."""
    # an engine started with enable_lora=True: described (and recorded) as vLLM loaded it
    with lora_layers_unwrapped(model):
        return _describe(model, vllm_config, worker_rank, options, old)


def _describe(model: Any, vllm_config: Any, worker_rank: int | None, options: dict,
              old: WorkerState | None) -> tuple[dict, WorkerState]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from fastsync import plugins
    from fastsync.layout.engine import engine_tensors_for_rank, vllm_rank_coords
    from fastsync.models.inventory import inventory_from_config

    unknown = set(options) - {"rank_offset", "config", "prepare", "layout"}
    if unknown:
        raise ConfigError(f"fastsync_describe: unknown option(s) {sorted(unknown)}")
    tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    rank = int(options.get("rank_offset", 0)) + int(tp_rank if worker_rank is None else worker_rank)
    config = options.get("config") or config_dict(vllm_config.model_config.hf_config)
    arch = (config.get("architectures") or ["?"])[0]
    live = read_live_params(model)
    dtypes = {lp.dtype for lp in live.values()}
    dtype = "bfloat16" if "bfloat16" in dtypes else sorted(dtypes)[0]
    name_map, recorded, recorded_s = _name_map(model, vllm_config, config, arch, options, tp_size, tp_rank, rank,
                                               dtype)
    param_shapes = recorded.params if recorded is not None else None
    inventory = None if param_shapes is not None else inventory_from_config(config, name=arch, dtype=dtype)
    # A plugin may describe this engine itself (fastsync_engine_layout); else the name map does.
    expected = plugins.hook().fastsync_engine_layout(engine=model, rank=rank)
    if expected is None:
        pc = vllm_config.parallel_config
        if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
            raise ConfigError("fastsync's vLLM extension does not describe pipeline-parallel engines yet")
        coords = vllm_rank_coords(tp_size=tp_size, tp_rank=tp_rank, dp_size=int(getattr(pc, "data_parallel_size", 1)),
                                  dp_rank=int(getattr(pc, "data_parallel_rank", 0)),
                                  enable_expert_parallel=bool(getattr(pc, "enable_expert_parallel", False)))
        expected = engine_tensors_for_rank(inventory, name_map, dtype=dtype, moe_pad=moe_padding(model), **coords)
    fb = Fallback.of(recorded, dtype, rank) if recorded is not None else None
    check_against(live, expected, rank=rank, loaded=fb.loads if fb is not None else ())
    if fb is not None:  # one buffer per fallback tensor: planned and written like any engine tensor
        expected.update(fb.engine_tensors())
    st = WorkerState(rank, tp_rank, tp_size, live, expected)
    if old is not None:  # describing again keeps the staging memory and the plain copy
        st.staging, st.plain, st.arenas = old.staging, old.plain, old.arenas
    if fb is not None:
        fb.adopt(old.fallback if old is not None else None)
    st.fallback = fb
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
    }, st


def _name_map(model: Any, vllm_config: Any, config: dict, arch: str, options: dict, tp_size: int, tp_rank: int,
              rank: int, dtype: str) -> tuple[Any, Any, float]:
    """The hand-written name map, or one recorded from vLLM's own loaders (``layout``
    option, default ``$FASTSYNC_VLLM_LAYOUT`` or ``auto``: hand-written where one exists,
    recorded otherwise; ``recorded``: always record; ``hand``: never). Returns the map, the
    recording (None: the hand map) and the seconds the recording took."""
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
    from fastsync.engines.vllm.recorded_map import refusal

    t0 = time.perf_counter()
    got = _record(model, vllm_config, arch, tp_size, tp_rank, dtype)
    if got.refused:
        raise refusal(got, rank)
    got.name_map.validate({n: _Shape(s) for n, s in got.params.items() if n not in got.fallback})
    log.info("fastsync: engine rank %d recorded its layout from vLLM's loaders: %d engine tensors from %d "
             "checkpoint tensors (%d fall back) in %.2f s", rank, len(got.name_map.params), len(got.params),
             len(got.fallback), time.perf_counter() - t0)
    return got.name_map, got, time.perf_counter() - t0


def _record(model: Any, vllm_config: Any, arch: str, tp_size: int, tp_rank: int, dtype: str) -> Any:
    from fastsync.engines.vllm.recorded_map import record_engine_layout

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    ep = tp_size * int(getattr(pc, "data_parallel_size", 1)) if getattr(pc, "enable_expert_parallel", False) else 1
    return record_engine_layout(model, mc.hf_config, model_dir=str(mc.model), architecture=arch, tp_size=tp_size,
                                tp_rank=tp_rank, ep_size=ep, model_dtype=dtype)


def record_layout(model: Any, vllm_config: Any) -> dict:
    """Record this worker's layout from vLLM's own loaders (no bytes move): the name map as JSON
    plus what was refused, for tests and tools."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from fastsync.layout.namemap_wire import name_map_to_json

    arch = (config_dict(vllm_config.model_config.hf_config).get("architectures") or ["?"])[0]
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
    t0 = time.perf_counter()
    got = _record(model, vllm_config, arch, get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank(),
                  "bfloat16" if "bfloat16" in dtypes else sorted(dtypes)[0])
    return {"name_map": name_map_to_json(got.name_map), "fallback": got.fallback,
            "loads": {p: list(xs) for p, xs in got.loads.items()}, "refused": got.refused,
            "params": {n: list(s) for n, s in got.params.items()}, "record_s": time.perf_counter() - t0}

