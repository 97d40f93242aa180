"""Built-in plugin: name maps (HF transformers-v5 names -> vLLM 0.32 engine tensors) for Llama,
Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V3/Kimi-K2, registered through the ``fastsync``
entry-point group like any third-party plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastsync.engines.vllm import ENGINE
from fastsync.hookspecs import hookimpl

if TYPE_CHECKING:
    from fastsync.layout.namemap import NameMap


@hookimpl
def fastsync_name_map(architecture: str, config: dict, engine: str) -> NameMap | None:
    if engine != ENGINE:
        return None
    from fastsync.engines.vllm.names import vllm_name_map

    return vllm_name_map(architecture, config)
