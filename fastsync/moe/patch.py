"""``patch(model, ep_group=None, backend="auto")``: swap every supported HF MoE block in place.

Order: resolve the backend once (errors for impossible requests come first, before anything
changes), find every sparse-MoE block, ask the ``fastsync_swap_moe`` hook for each replacement
(fastsync's built-in answers for the classes in ``fastsync.moe.block.SUPPORTED``), and only when
every replacement is built, install them all. A block no plugin swaps is left untouched with a
warning naming its class; a block that cannot honour the settings (``ep_size`` not dividing the
experts) is a ``MoEPatchError`` and nothing is swapped.

Call it on every training rank, after loading weights and before wrapping (FSDP/DDP) or building
the optimizer: the expert parameters of an EP rank are new tensors (its shard).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from fastsync import plugins
from fastsync.errors import MoEPatchError
from fastsync.moe.block import FastExperts, FastSyncMoEBlock, ep_shard, install_block, is_moe_block, resolve_backend
from fastsync.moe.replay import RoutingReplay

__all__ = ["patch", "ep_shards", "expert_param_bytes"]

log = logging.getLogger("fastsync.moe")


def patch(
    model: nn.Module, ep_group: Any = None, backend: str = "auto", *, replay: RoutingReplay | None = None
) -> dict[str, str]:
    """Swap the model's MoE blocks; returns {block name: HF class name} of what was swapped.

    ``ep_group``: a torch.distributed process group over which experts are sharded (None: no
    expert parallelism). ``backend``: ``"auto"``, ``"torch"``, ``"grouped_mm"``, ``"te"``,
    ``"deepep"``. ``replay``: a ``RoutingReplay`` the blocks consult after routing.

    Under EP each rank routes its own tokens and holds 1/ep_size of every expert tensor; the
    router and shared experts stay replicated, so their gradients need the usual data-parallel
    all-reduce over the EP ranks (FSDP/DDP does it when the EP ranks are also DP ranks).
    ``state_dict()`` is collective under EP (it all-gathers expert shards to HF's full shapes).

    Example::

        model = AutoModelForCausalLM.from_pretrained(path)      # HF v5 MoE model
        fastsync.moe.patch(model, ep_group=ep_group)            # every training rank, same group
        model = fully_shard(model, ...)                         # then wrap, then the optimizer
        optimizer = torch.optim.AdamW(model.parameters())
        loss = model(**batch).loss; loss.backward(); optimizer.step()
    """
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    chosen = resolve_backend(backend, device, ep_group)
    ep_size = torch.distributed.get_world_size(ep_group) if ep_group is not None else 1
    config = getattr(model, "config", None)
    blocks = [(n, m) for n, m in model.named_modules() if n and is_moe_block(m) and not isinstance(m, FastSyncMoEBlock)]
    hook = plugins.hook()
    replacements: list[tuple[str, nn.Module]] = []
    skipped: dict[str, list[str]] = {}
    for name, module in blocks:
        new = hook.fastsync_swap_moe(module=module, name=name, config=config, ep_group=ep_group, backend=backend)
        if new is None:
            skipped.setdefault(type(module).__name__, []).append(name)
        else:
            replacements.append((name, new))
    for cls_name, names in skipped.items():
        warnings.warn(
            f"fastsync.moe.patch: {cls_name} is not a supported MoE block; left untouched "
            f"({len(names)} block(s), e.g. {names[0]})",
            stacklevel=2,
        )
    for name, new in replacements:
        if isinstance(new, FastSyncMoEBlock):
            new._fastsync_replay = replay
            install_block(new)
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
    if replacements:
        log.info("%s; swapped %d block(s)", chosen.describe(backend, ep_size), len(replacements))
    if replay is not None and not replacements:
        raise MoEPatchError("routing replay requested but no MoE block was swapped")
    return {name: type(new).__mro__[2].__name__ if isinstance(new, FastSyncMoEBlock) else type(new).__name__
            for name, new in replacements}


def ep_shards(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """{parameter name: (start, stop, full_dim0)} for expert parameters held as EP shards:
    this rank holds rows [start, stop) of dim 0 of the full HF tensor."""
    return {n: s for n, p in model.named_parameters() if (s := ep_shard(p)) is not None}


def expert_param_bytes(model: nn.Module) -> int:
    """Bytes of routed-expert parameters this process holds (its shard under EP)."""
    total = 0
    for module in model.modules():
        if isinstance(module, FastExperts):
            total += sum(getattr(module, n).numel() * getattr(module, n).element_size() for n in module.expert_param_names)
    return total
