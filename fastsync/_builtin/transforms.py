"""Built-in plugin: transforms. Registered through the `fastsync` entry-point group like any plugin.

Each registration carries ``elementwise``: True when the transform of a sub-box equals the
sub-box of the transform (so the planner may slice freely), and ``block``: the block edge when
the transform works on whole blocks over the last two dims (the planner only cuts at block
boundaries or gathers). A plugin transform registered without either is treated as needing its
whole piece, so the planner gathers its parameter onto an owner rank.
"""

from __future__ import annotations

from collections.abc import Callable

from fastsync.hookspecs import hookimpl


@hookimpl
def fastsync_register_transforms(register: Callable[..., None]) -> None:
    from fastsync.executor import transforms as t

    register("copy", t.copy_transform, elementwise=True)
    register("fp8_block", t.fp8_block_transform, block=t.FP8_BLOCK)
    register("fp8_scale", t.fp8_scale_transform, block=t.FP8_BLOCK)
