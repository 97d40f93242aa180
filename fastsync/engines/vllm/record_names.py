"""Which tensors a trainer sends and under what names vLLM's loaders know them (no bytes read).

* :func:`checkpoint_params`: the trainer's tensors, names, shapes and dtypes: the transformers
  model built from the config on the meta device, else the safetensors headers.
* :func:`loader_names`: transformers v5 renames some checkpoint keys (``conversion_mapping``);
  the recorder hands vLLM the checkpoint's name and keeps the trainer's in the recording.
* :func:`expert_splits`: transformers v5 fuses per-expert weights (``experts.*.gate_proj`` +
  ``up_proj`` -> ``experts.gate_up_proj`` [E, 2I, H], ``experts.*.down_proj`` ->
  ``experts.down_proj``). vLLM loaders written for the per-expert checkpoint (DeepSeek-V2/V3's)
  take only per-expert names; for those the recorder feeds each fused tensor as its per-expert
  views (boxes of the fused tensor), so the recording still says where each trainer byte lands.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from fastsync.engines.vllm.record import TIED, storage_id
from fastsync.errors import LayoutError

__all__ = ["checkpoint_params", "hf_params", "safetensors_params", "loader_names", "expert_splits"]



def safetensors_params(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of every tensor in ``model_dir``'s ``*.safetensors`` files, read
    from their JSON headers only (8 bytes of length, then the header)."""
    names = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not names:
        raise LayoutError(f"{model_dir!r} holds no *.safetensors file to read parameter names from")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    dtypes = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
    for fname in names:
        with open(os.path.join(model_dir, fname), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100 << 20:
                raise LayoutError(f"{fname!r}: safetensors header of {n} bytes is not plausible")
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            dt = dtypes.get(v.get("dtype"))
            if dt is None:
                raise LayoutError(f"checkpoint tensor {k!r} in {fname!r} has dtype {v.get('dtype')!r}; recording "
                                  f"handles floating-point checkpoints only ({sorted(dtypes)})")
            out[k] = (tuple(int(x) for x in v["shape"]), dt)
    return out


def hf_params(hf_config: Any) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """The trainer's names: a transformers model built from the config on the meta device (no
    memory), its ``state_dict()`` names, shapes and dtypes (transformers v5 names, e.g. fused
    ``experts.gate_up_proj``, exactly what an HF trainer holds). None when transformers cannot
    build it."""
    try:
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception:
        return None
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    seen: dict[int, str] = {}
    for n, t in model.state_dict().items():
        first = seen.setdefault(storage_id(t), n)
        # a tied tensor (lm_head.weight = embed_tokens.weight): listed, never fed to the loaders
        out[n] = (tuple(t.shape), f"{TIED}{first}" if first != n else str(t.dtype).removeprefix("torch."))
    return out


def _literal(pattern: str) -> str | None:
    """A regex pattern as the literal string it matches, when it is one (escaped dots allowed)."""
    body = pattern.replace("\\.", ".")
    if any(ch in body for ch in "*+?[](){}|\\^$"):
        return None
    return body


#: per-expert checkpoint names -> vLLM's name for the same experts fused (``build_expert_params_
#: mapping(include_fused=True)``)
_VLLM_FUSED = {("w1", "w3"): "w13", ("gate_proj", "up_proj"): "gate_up_proj"}


def _expert_converter(t: Any) -> tuple[str, list[str]] | None:
    """A transformers expert-merging converter as (its target, literal; its source patterns with
    dots unescaped), e.g. (``mlp.experts.gate_up_proj``, [``mlp.experts.*.gate_proj.weight``, ...]);
    None for any other conversion."""
    srcs = [sp.replace("\\.", ".") for sp in getattr(t, "source_patterns", []) or []]
    tgts = list(getattr(t, "target_patterns", []) or [])
    if type(t).__name__ != "WeightConverter" or len(tgts) != 1 or not srcs:
        return None
    tgt = _literal(tgts[0])
    if tgt is None or not all("experts.*." in sp for sp in srcs):
        return None
    return tgt, srcs


def _fused_expert_name(t: Any) -> tuple[str, str] | None:
    """For transformers' expert-merging converter (``.experts.*.w1.weight`` + ``.experts.*.w3.weight``
    -> ``.experts.gate_up_proj``), the fused name pair (transformers', vLLM's)."""
    conv = _expert_converter(t)
    if conv is None:
        return None
    tgt, srcs = conv
    names = []
    for body in srcs:
        if not (body.startswith(".experts.*.") and body.endswith(".weight")):
            return None
        names.append(body[len(".experts.*."):-len(".weight")])
    fused = _VLLM_FUSED.get(tuple(names), names[0] if len(names) == 1 else None)
    if not tgt.startswith(".experts.") or fused is None:
        return None
    return tgt, f".experts.{fused}"


def loader_names(hf_config: Any, names: list[str]) -> dict[str, str]:
    """trainer (transformers v5) name -> the name vLLM's loader knows: transformers' own key
    renamings for the model type (``conversion_mapping``: e.g. Mixtral's ``.block_sparse_moe.`` ->
    ``.mlp.``) applied in reverse, so vLLM sees the checkpoint's name while the recording keeps
    the trainer's. Fused-tensor conversions are left alone (vLLM loads fused experts itself)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        mapping = get_checkpoint_conversion_mapping(getattr(hf_config, "model_type", None)) or []
    except Exception:
        return {n: n for n in names}
    rev: list[tuple[str, str, bool]] = []
    for t in mapping:
        fused = _fused_expert_name(t)
        if fused is not None:
            rev.append((*fused, False))
            continue
        if type(t) is not WeightRenaming or len(t.source_patterns) != 1 or len(t.target_patterns) != 1:
            continue
        src, tgt = t.source_patterns[0], t.target_patterns[0]
        anchored = src.startswith("^")
        a, b = _literal(tgt), _literal(src.removeprefix("^"))
        if a and b is not None:
            rev.append((a, b, anchored))
    out = {}
    for n in names:
        m = n
        for a, b, anchored in rev:
            if anchored:
                m = b + m[len(a):] if m.startswith(a) else m
            else:
                m = m.replace(a, b)
        out[n] = m
    return out


def checkpoint_params(hf_config: Any, model_dir: str | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """What the trainer will send: the transformers model's names from the config, else the
    safetensors headers of ``model_dir``."""
    got = hf_params(hf_config)
    if got:
        return got
    if model_dir and os.path.isdir(model_dir):
        return safetensors_params(model_dir)
    raise LayoutError(f"cannot list the checkpoint's parameters: transformers cannot build the config and "
                      f"{model_dir!r} is not a local directory with safetensors files")


def expert_splits(hf_config: Any, params: dict[str, tuple[tuple[int, ...], str]],
                  names: dict[str, str]) -> dict[str, list[tuple[str, tuple[int, slice]]]]:
    """For each fused expert tensor of ``params`` (transformers' expert-merging converters), its
    per-expert pieces as the original checkpoint named them: trainer name -> [(loader name,
    (expert, slice of dim 1))], pieces in the converter's order along dim 1 (gate, then up).
    ``names``: the loader name of each trainer tensor."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        mapping = get_checkpoint_conversion_mapping(getattr(hf_config, "model_type", None)) or []
    except Exception:
        return {}
    out: dict[str, list[tuple[str, tuple[int, slice]]]] = {}
    for t in mapping:
        conv = _expert_converter(t)
        if conv is None or "experts." not in conv[0]:
            continue
        tgt, srcs = conv
        pieces = [sp.split("experts.*.", 1)[1] for sp in srcs]  # e.g. gate_proj.weight, up_proj.weight
        stem = tgt.rsplit("experts.", 1)[0] + "experts."  # mlp.experts.
        for name, (shape, _) in params.items():
            if not (name == tgt or name.endswith("." + tgt)) or len(shape) != 3 or shape[1] % len(pieces):
                continue
            loader = names.get(name, name)
            base = (loader[: -len(tgt)] if loader.endswith(tgt) else name[: -len(tgt)]) + stem
            step = shape[1] // len(pieces)
            out[name] = [(f"{base}{e}.{piece}", (e, slice(k * step, (k + 1) * step)))
                         for e in range(shape[0]) for k, piece in enumerate(pieces)]
    return out
