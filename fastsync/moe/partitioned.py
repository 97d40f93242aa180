"""Swap the HF MoE blocks of a model DeepSpeed ZeRO-3 built partitioned (``HfDeepSpeedConfig`` ->
``zero.Init``: every parameter an empty ``ds_tensor`` holder; OpenRLHF's ``Actor`` builds so).

:func:`patch_partitioned` swaps one MoE block at a time with that block's parameters gathered
(``deepspeed.zero.GatheredParameters``, read-only), so only one block is ever whole; the new
block's parameters are ordinary tensors, which ``deepspeed.initialize`` then partitions like any
other. Parameter names stay the HF ones, so the weight sync plans them as before. Dense models and
unpartitioned ones (no ``ds_id``: DeepSpeed is then not imported) pass through ``fastsync.moe.patch``
block by block.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch.nn as nn

from fastsync.moe.patch import patch

__all__ = ["patch_partitioned"]

log = logging.getLogger("fastsync.moe")


class _Holder(nn.Module):
    """A one-block model for ``fastsync.patch_moe`` (which swaps children of the module it is
    given and reads ``config`` from it)."""

    def __init__(self, config: Any, block: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.block = block


def patch_partitioned(model: nn.Module, backend: str = "auto") -> dict[str, str]:
    """Swap every MoE block of ``model`` in place (see module doc); returns {block name: HF class}."""
    config = getattr(model, "config", None)
    candidates = [(n, m) for n, m in model.named_modules() if n and isinstance(getattr(m, "experts", None), nn.Module)]
    swapped: dict[str, str] = {}
    for name, block in candidates:
        partitioned = [p for p in block.parameters() if hasattr(p, "ds_id")]
        if partitioned:
            import deepspeed

            ctx: Any = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
        else:
            ctx = nullcontext()
        holder = _Holder(config, block)
        with ctx:
            got = patch(holder, ep_group=None, backend=backend)
            if got:  # copy out of the gathered storage before DeepSpeed re-partitions it
                for p in holder.block.parameters():
                    if not hasattr(p, "ds_id"):
                        p.data = p.data.clone()
        if got:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, holder.block)
            swapped[name] = got["block"]
    log.info("fastsync: swapped %d MoE block(s) of the ZeRO-3 model (%s backend)", len(swapped), backend)
    return swapped
