"""fastsync's hook specifications: the only way things plug into fastsync.

fastsync's own transports, layouts, name maps, model presets and MoE swaps register through these
same hooks (see ``fastsync/_builtin/``), exactly as a third-party plugin does through the
``fastsync`` entry-point group. Hooks are called with keyword arguments. Arguments may be added to
a spec later; they are never renamed or removed (pluggy passes a plugin only the ones it names).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # types only: hookspecs import nothing else from fastsync at run time
    import torch

    from fastsync.layout.namemap import NameMap
    from fastsync.layout.types import EngineTensor, TrainerLayout
    from fastsync.plan.types import Plan

__all__ = ["hookspec", "hookimpl", "PROJECT"]

PROJECT = "fastsync"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---- registration hooks: called once per process when the registry is first used ----------


@hookspec
def fastsync_register_transports(register: Callable[..., None]) -> None:
    """Register transport backends.

    Called by ``fastsync.plugins.transports()`` the first time a process asks for a transport
    (trainer and engine ranks alike). Call ``register(name, factory, available=..., why=...)``
    once per backend: ``factory(**options)`` returns a ``fastsync.transport.base.Transport``;
    ``available`` (bool) says whether it can run in this process, ``why`` says what to install
    when it cannot. A name registered twice is a PluginError naming both plugins.
    """


@hookspec
def fastsync_register_layouts(register: Callable[..., None]) -> None:
    """Register layout kinds usable in spec strings (``fsdp:8``, ``zero3:4``, ``vllm:tp8xep4*4``).

    Called by ``fastsync.plugins.layout_kinds()`` on any rank that parses a spec (the planner's
    host, the CLI). Call ``register(kind, builder, side=...)`` where ``side`` is ``"trainer"`` or
    ``"engine"``. A trainer builder is ``builder(args: str, inventory) -> TrainerLayout``; an engine
    builder is ``builder(args: str, inventory, name_map) -> EngineLayout``. ``args`` is the text
    after ``kind:``.
    """


@hookspec
def fastsync_register_models(register: Callable[..., None]) -> None:
    """Register model presets (parameter inventories built from published configs).

    Called by ``fastsync.plugins.model_presets()`` wherever a preset name is resolved (CLI,
    benchmarks). Call ``register(name, config_factory)``; ``config_factory()`` returns an
    HF-style ``config.json`` dict. Nothing is downloaded.
    """


@hookspec
def fastsync_register_architectures(register: Callable[..., None]) -> None:
    """Register model architectures (config.json ``architectures[0]``) whose parameters fastsync
    can enumerate from a config alone.

    Called by ``fastsync.plugins.architectures()`` wherever an inventory is built from a config
    (CLI, planner's host, engine receivers). Call ``register(architecture, enumerate_params,
    model_types=(...))``: ``enumerate_params(config) -> list[(name, shape)]`` lists the HF
    (transformers v5) parameters in order; ``model_types`` are the config ``model_type`` values
    that mean this architecture when ``architectures`` is missing.
    """


@hookspec(firstresult=True)
def fastsync_name_map(architecture: str, config: dict, engine: str) -> NameMap | None:
    """Return the name map for an HF architecture (e.g. ``"Qwen3MoeForCausalLM"``) on inference
    engine ``engine`` (e.g. ``"vllm"``), or None when the plugin does not know that pair.

    Called by the planner's host and by engine receivers when they build an engine layout, once
    per layout build. The name map (``fastsync.layout.namemap.NameMap``) turns trainer (HF
    transformers-v5) names into the engine's fused, parallel-annotated tensors.
    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def fastsync_trainer_layout(model: Any, rank: int, world_size: int) -> TrainerLayout | None:
    """Describe a live trainer model's sharding as a ``TrainerLayout``, or None if not yours.

    Called by ``WeightSync`` once at setup on every trainer rank, with the rank's model object
    (an FSDP2 / DTensor module, a DeepSpeed engine, a Megatron model, a plain module). The built-in
    handles DTensor placements and plain modules. Stops at first non-None result.
    """


@hookspec(firstresult=True)
def fastsync_engine_layout(engine: Any, rank: int) -> dict[str, EngineTensor] | None:
    """Describe a live inference engine's parameters on this rank as ``EngineTensor``s, or None.

    Called inside each inference worker (e.g. the vLLM worker extension) once at setup.
    Shapes are the engine's own: where it pads a tensor, give its allocated ``shape``, the
    ``logical_shape`` and pieces in the padded coordinates (``fastsync.pad_tensor``).
    Stops at first non-None result.
    """


@hookspec
def fastsync_register_transforms(register: Callable[..., None]) -> None:
    """Register tensor transforms named in ``Piece.transform`` (``copy``, ``fp8_block``, ...).

    Called by the executor on trainer ranks the first time it runs a plan. Call
    ``register(name, fn)`` with ``fn(src_tensor, dst_dtype) -> tensor`` producing the bytes that
    land at the destination, in the destination's row-major order.
    """


# ---- per-sync hooks --------------------------------------------------------------------------


@hookspec
def fastsync_before_sync(version: int, role: str, rank: int, plan: Plan | None) -> None:
    """Called on every rank (``role`` is ``"trainer"`` or ``"engine"``) right before a sync of
    ``version`` starts, before any byte moves: the place to pause generation, fence, or start timers.
    An exception aborts the sync; receivers keep their previous version."""


@hookspec
def fastsync_after_sync(version: int, role: str, rank: int, metrics: dict, ok: bool) -> None:
    """Called on every rank after a sync of ``version`` finished (``ok``) or failed: the place to
    record metrics (seconds per stage, bytes per link) or resume generation. Exceptions here are
    reported but do not undo the sync."""


# ---- MoE --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def fastsync_swap_moe(module: torch.nn.Module, name: str, config: Any, ep_group: Any, backend: str) -> torch.nn.Module | None:
    """Return a replacement for one MoE block of an HF model, or None to leave it alone.

    Called by ``fastsync.moe.patch(model, ...)`` on every training rank, once per submodule whose
    class is a sparse-MoE block, before training starts. ``name`` is the submodule's qualified name,
    ``ep_group`` the expert-parallel process group (or None), ``backend`` the requested expert
    backend (``"auto"``, ``"torch"``, ``"grouped_mm"``, ``"te"``, ``"deepep"``).
    The replacement must keep the block's parameter names and shapes in ``state_dict()``.
    Stops at first non-None result.
    """
