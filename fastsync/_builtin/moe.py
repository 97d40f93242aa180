"""Built-in plugin: moe. Registered through the `fastsync` entry-point group like any plugin.

Answers ``fastsync_swap_moe`` for the HF v5 block classes in ``fastsync.moe.block.SUPPORTED``
(Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, GPT-OSS); None for anything else.
"""

from __future__ import annotations

from typing import Any

from fastsync.hookspecs import hookimpl


@hookimpl
def fastsync_swap_moe(module: Any, name: str, config: Any, ep_group: Any, backend: str) -> Any:
    from fastsync.moe.block import build_block  # torch only when a swap is asked for

    return build_block(module, name, ep_group, backend)
