"""Parameter inventories: the trainer-side names, full shapes and dtypes of a model, built from
its ``config.json`` alone (a preset or a local HF directory). Nothing is downloaded or allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fastsync.errors import ConfigError
from fastsync.layout.config_json import read_config_json
from fastsync.layout.limits import MAX_MODEL_BYTES
from fastsync.layout.types import DTYPE_BYTES, ParamSpec
from fastsync.models.archs import EXPERT_FORMAT_KEY, enumerate_params

__all__ = ["Inventory", "load_inventory", "inventory_from_config", "config_dtype"]

_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "bf16": "bfloat16",
                 "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}


@dataclass(slots=True)
class Inventory:
    """A model's parameters keyed by HF transformers-v5 ``state_dict()`` name, in model order.

    ``architecture`` is ``config["architectures"][0]`` (e.g. ``"Qwen3MoeForCausalLM"``) and
    ``config`` the HF ``config.json`` dict it was built from.
    """

    name: str
    architecture: str
    config: dict
    params: dict[str, ParamSpec]

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params.values())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


def config_dtype(config: dict) -> str:
    """The dtype a config declares (``torch_dtype`` or v5's ``dtype``), bfloat16 when absent."""
    raw = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    raw = str(raw).removeprefix("torch.")
    if raw not in _TORCH_DTYPES:
        raise ConfigError(f"config dtype {raw!r} not supported; use one of {sorted(set(_TORCH_DTYPES.values()))}")
    return _TORCH_DTYPES[raw]


def inventory_from_config(config: dict, *, name: str = "custom", dtype: str | None = None,
                          fused_experts: bool | None = None) -> Inventory:
    """Build the inventory of an HF config dict. ``dtype`` overrides the config's dtype (e.g.
    ``"float32"`` for an FSDP trainer that keeps fp32 master weights). ``fused_experts=False``
    lists MoE experts one ``nn.Linear`` per expert (``experts.{e}.gate_proj.weight`` ...) instead
    of transformers v5's fused ``experts.gate_up_proj``/``down_proj``; the choice is recorded in
    the inventory's config under ``fastsync_expert_format`` so name maps follow it."""
    from fastsync import plugins

    if not isinstance(config, dict):
        raise ConfigError(f"model {name!r}: config must be a JSON object, got {type(config).__name__}")
    registered = plugins.architectures()
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"model {name!r}: config key 'architectures' must be a list of names, got {archs!r}")
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"model {name!r}: config key 'model_type' must be a string, got {model_type!r}")
    if not archs:
        by_type = {t: a for a, r in registered.items() for t in r.extra.get("model_types", ())}
        if model_type in by_type:
            archs = [by_type[config["model_type"]]]
    if not archs:
        raise ConfigError(f"model {name!r}: config.json has no 'architectures' entry; supported: {sorted(registered)}")
    arch = archs[0]
    config = dict(config, architectures=list(archs))
    if fused_experts is not None:
        config[EXPERT_FORMAT_KEY] = "fused" if fused_experts else "per_expert"
    if arch not in registered:
        raise ConfigError(f"model {name!r}: unsupported architecture {arch!r}; supported: {sorted(registered)}")
    dt = dtype if dtype is not None else config_dtype(config)
    if dt not in DTYPE_BYTES:
        raise ConfigError(f"model {name!r}: unknown dtype {dt!r}; known: {sorted(DTYPE_BYTES)}")
    params = {n: ParamSpec(n, shape, dt) for n, shape in enumerate_params(arch, config)}
    nbytes = sum(p.nbytes for p in params.values())
    if nbytes > MAX_MODEL_BYTES:
        raise ConfigError(f"model {name!r}: config.json describes {nbytes / 1e12:.3g} TB of parameters, over the "
                          f"limit {MAX_MODEL_BYTES / 1e12:.3g} TB (check vocab_size, hidden_size and the layer counts)")
    return Inventory(name=name, architecture=arch, config=dict(config), params=params)


def _presets() -> dict:
    from fastsync import plugins

    return plugins.model_presets()


def load_inventory(preset_or_dir: str, *, dtype: str | None = None, fused_experts: bool | None = None) -> Inventory:
    """The inventory of a registered preset (``qwen3-30b-a3b``, ``kimi-k2``, ...) or of a local
    directory holding an HF ``config.json`` (or the path of that file).

    Raises ConfigError naming the preset/directory and listing the known presets."""
    presets = _presets()
    if preset_or_dir in presets:
        config = presets[preset_or_dir].obj()
        return inventory_from_config(config, name=preset_or_dir, dtype=dtype, fused_experts=fused_experts)
    path = preset_or_dir
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"directory {preset_or_dir!r} has no config.json; known presets: {sorted(presets)}")
    elif not (os.path.isfile(path) and path.endswith(".json")):
        raise ConfigError(
            f"unknown model {preset_or_dir!r}: neither a registered preset nor a directory with config.json; "
            f"known presets: {sorted(presets)}"
        )
    config = read_config_json(path)
    return inventory_from_config(config, name=preset_or_dir, dtype=dtype, fused_experts=fused_experts)
