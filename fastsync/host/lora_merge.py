"""A PEFT LoRA policy's merged weights, per trainer rank, for a DeepSpeed job whose engines serve
the policy as a plain checkpoint (OpenRLHF with ``--ds.lora.rank``: its vLLM engines run without
LoRA). Every LoRA-targeted ``Linear`` is sent as ``W + scaling * B @ A`` under the base name
(``...q_proj.base_layer.weight`` -> ``...q_proj.weight``); every other base parameter goes as
it is, from the trainer's own memory (:func:`fastsync.sync.peft_sync.base_view`); the adapter
matrices themselves are not sent.

Nothing is gathered but the adapters (``r x in`` and ``out x r``: megabytes). Each rank merges
only the flat slice of each targeted weight it owns: under ZeRO-3 its ``ds_tensor`` partition,
below stage 3 (whole parameters on every rank) the same ``ceil(n/N)`` slice, so the ranks
split the merged bytes as ZeRO-3 would. The merged slices live in one registered staging buffer
per targeted weight (about 1/N of the targeted weights per rank, kept for the session: the
trainer's own memory is never changed). Order, on every rank::

    merged = MergedLoraSources(peft_model, rank=r, world_size=n)   # refusals, before any byte moves
    layout, sources = merged.plan()                                  # once per (re-)plan
    merged.refresh()   # collective, before every sync: adapters gathered, slices merged
    ... WeightSync(layout=layout, sources=sources).sync(v)

The merge is PEFT's own (``merge_and_unload``): ``W + (B @ A) * scaling`` in PEFT's dtypes and
order (:func:`merged_slice`), ``scaling`` the layer's (``lora_alpha / r``, or
``/ sqrt(r)`` with ``use_rslora``, per-module ``rank_pattern`` / ``alpha_pattern`` included).
PEFT settings whose merge is not that (DoRA and the other LoRA variants, ``lora_bias``,
``modules_to_save``, ``fan_in_fan_out``, non-``Linear`` targets, ...) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastsync.errors import ConfigError, LayoutError
from fastsync.layout.trainer import zero3_layout
from fastsync.layout.types import ParamSpec, TrainerLayout
from fastsync.sync.local_sources import local_sources
from fastsync.sync.peft_sync import base_view, is_peft_model

__all__ = ["MergedLoraSources", "LoraTarget", "check_mergeable", "lora_config_refusal", "lora_delta",
           "lora_targets", "merged_slice"]

#: LoraConfig settings whose merged model is not ``W + scaling * B @ A`` on the base names, with
#: what each does; a truthy value is refused
_REFUSED_SETTINGS = {
    "use_dora": "DoRA rescales each merged column by a learned magnitude",
    "modules_to_save": "trained full copies of modules, not in the base weights",
    "trainable_token_indices": "trained rows of the embedding, kept beside it",
    "lora_bias": "a trained bias on lora_B",
    "fan_in_fan_out": "transposed (Conv1D) base weights",
    "layer_replication": "layers shared between positions of the stack",
    "target_parameters": "LoRA on bare nn.Parameters (e.g. fused MoE experts)",
    "alora_invocation_tokens": "activated LoRA, applied only after its invocation tokens",
    "use_qalora": "QA-LoRA's pooled input",
    "use_bdlora": "BD-LoRA's block-diagonal factors",
}


@dataclass(slots=True)
class LoraTarget:
    """One targeted Linear: its weight under the base name, and its adapter matrices."""

    name: str  # the base checkpoint's name of the weight, e.g. model.layers.0.self_attn.q_proj.weight
    weight: torch.nn.Parameter  # the base layer's weight (a ZeRO-3 parameter or a whole one)
    lora_a: torch.nn.Parameter  # r x in
    lora_b: torch.nn.Parameter  # out x r
    scaling: float


def _active_adapter(peft_model: Any) -> str:
    active = list(getattr(peft_model, "active_adapters", None) or [peft_model.active_adapter])
    if len(active) != 1:
        raise ConfigError(f"PEFT model with {len(active)} active adapters {active}: the merged sync serves one")
    return str(active[0])


def lora_config_refusal(config: Any, adapter: str) -> str | None:
    """Why adapter ``adapter``'s PEFT config merges into something other than ``W + scaling * B @ A``
    on the base names (the PEFT type, or the ``LoraConfig`` setting and what it does), or None.
    The one rule for every merged LoRA sync: ``DeepSpeedWeightSync`` here, verl's per-shard merge."""
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None)))
    if kind != "LORA":
        return f"PEFT adapter {adapter!r} is {kind}, not LoRA"
    for key, why in _REFUSED_SETTINGS.items():
        value = getattr(config, key, None)
        if value:
            return f"PEFT adapter {adapter!r}: LoraConfig.{key}={value!r} ({why})"
    return None


def check_mergeable(peft_model: Any) -> str:
    """The active adapter's name; ConfigError naming the PEFT setting when its merge is not
    ``W + scaling * B @ A`` (see the module doc)."""
    if not is_peft_model(peft_model):
        raise ConfigError(f"merged LoRA sync needs a PEFT model, got {type(peft_model).__name__}")
    adapter = _active_adapter(peft_model)
    why = lora_config_refusal(peft_model.peft_config[adapter], adapter)
    if why is not None:
        raise ConfigError(f"{why}: not supported by the merged LoRA sync")
    return adapter


def lora_targets(peft_model: Any, adapter: str) -> list[LoraTarget]:
    """Every LoRA layer of ``adapter``, checked layer by layer (ConfigError naming the module):
    a plain ``torch.nn.Linear`` base, no LoRA variant, not already merged, adapters enabled."""
    out = []
    for name, m in peft_model.get_base_model().named_modules():
        lora_a = getattr(m, "lora_A", None)
        if lora_a is None or not hasattr(m, "base_layer"):
            continue
        embed = getattr(m, "lora_embedding_A", None)
        if adapter not in lora_a and not (embed is not None and adapter in embed):
            continue
        base = m.base_layer
        if type(base) is not torch.nn.Linear:
            raise ConfigError(f"PEFT module {name!r}: LoRA on a {type(base).__module__}.{type(base).__qualname__} "
                              "is not supported by the merged LoRA sync (torch.nn.Linear only)")
        variant = getattr(m, "lora_variant", {}).get(adapter)
        if variant is not None:
            raise ConfigError(f"PEFT module {name!r}: LoRA variant {type(variant).__name__} is not supported by the "
                              "merged LoRA sync")
        for flag, why in (("lora_bias", "lora_bias"), ("use_dora", "DoRA")):
            if getattr(m, flag, {}).get(adapter):
                raise ConfigError(f"PEFT module {name!r}: {why} is not supported by the merged LoRA sync")
        if getattr(m, "fan_in_fan_out", False):
            raise ConfigError(f"PEFT module {name!r}: fan_in_fan_out is not supported by the merged LoRA sync")
        if getattr(m, "merged_adapters", None):
            raise ConfigError(f"PEFT module {name!r}: adapters {list(m.merged_adapters)} are already merged into its "
                              "base weight (unmerge() first)")
        if getattr(m, "disable_adapters", False):
            raise ConfigError(f"PEFT module {name!r}: adapters are disabled; the engines would serve the base model")
        out.append(LoraTarget(f"{name}.weight", base.weight, lora_a[adapter].weight, m.lora_B[adapter].weight,
                              float(m.scaling[adapter])))
    if not out:
        raise LayoutError(f"the PEFT model has no LoRA layer of adapter {adapter!r}")
    return out


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in getattr(p, "ds_shape", p.shape))


#: the fewest rows multiplied at once: BLAS kernels round a row of ``B @ A`` the same as in the whole
#: product only from a few rows up (single rows go through another path: 1 ulp apart on this CPU)
MIN_ROWS = 64


def lora_delta(lora_b: torch.Tensor, lora_a: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's ``Linear.get_delta_weight`` on rows of B and columns of A: ``(B @ A) * scaling`` in B's
    dtype, 16-bit adapters on CPU computed in float32 and cast back, as PEFT does. The one delta of
    every merged LoRA sync (:func:`merged_slice` here, verl's per-shard merge)."""
    dtype = lora_b.dtype
    if lora_b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        return ((lora_b.float() @ lora_a.float()) * scaling).to(dtype)
    return (lora_b @ lora_a.to(dtype)) * scaling


def merged_slice(base_flat: torch.Tensor, start: int, shape: tuple[int, int], lora_a: torch.Tensor,
                 lora_b: torch.Tensor, scaling: float, out: torch.Tensor) -> None:
    """Write elements ``[start, start + len(base_flat))`` of the row-major merged weight into
    ``out`` (``base_flat``: those elements of W), as PEFT's ``merge`` computes it: the delta
    ``(B @ A) * scaling`` in B's dtype (through float32 for 16-bit adapters on CPU), added to W in
    the promoted dtype, rounded once to W's. Only the rows the slice touches are multiplied (at
    least :data:`MIN_ROWS`)."""
    num = base_flat.numel()
    if num == 0:
        return
    rows, cols = shape
    row0, row1 = start // cols, -(-(start + num) // cols)
    lo = max(0, min(row0, rows - MIN_ROWS))
    hi = max(row1, min(rows, lo + MIN_ROWS))
    device = base_flat.device
    delta = lora_delta(lora_b[lo:hi].to(device), lora_a.to(device), scaling).reshape(-1)
    off = start - lo * cols
    torch.add(base_flat, delta[off:off + num], out=out[:num])


class MergedLoraSources:
    """One trainer rank's merged view of a PEFT policy (module doc). ConfigError / LayoutError
    naming the setting or module at construction, before anything is planned."""

    def __init__(self, peft_model: Any, *, rank: int, world_size: int) -> None:
        self.adapter = check_mergeable(peft_model)
        self.peft_model, self.rank, self.world_size = peft_model, rank, world_size
        self.view = base_view(peft_model)  # refuses modules_to_save by parameter name too
        self.targets = lora_targets(peft_model, self.adapter)
        names = {n for n, _ in self.view.named_parameters()}
        missing = [t.name for t in self.targets if t.name not in names]
        if missing:
            raise LayoutError(f"LoRA target weight {missing[0]!r} is not among the base model's parameters")
        self.staging: dict[str, torch.Tensor] = {}

    def _bounds(self, t: LoraTarget) -> tuple[int, int, int]:
        """This rank's flat slice of a targeted weight: start, end, the padded partition size."""
        numel = 1
        for n in _shape(t.weight):
            numel *= n
        part = -(-numel // self.world_size)
        return min(self.rank * part, numel), min((self.rank + 1) * part, numel), part

    def plan(self) -> tuple[TrainerLayout, dict[str, torch.Tensor]]:
        """The trainer layout under the base names (targeted weights split into ZeRO-3's flat
        slices whatever the stage) and this rank's sources: its own memory for the untargeted
        parameters, a staging buffer (allocated once) for each targeted slice."""
        from fastsync import plugins

        layout = plugins.hook().fastsync_trainer_layout(model=self.view, rank=self.rank, world_size=self.world_size)
        if layout is None:
            raise LayoutError("no plugin describes the PEFT model's base view")
        targeted = {t.name: t for t in self.targets}
        split = zero3_layout({n: layout.params[n] for n in targeted}, self.world_size)
        shards = {n: split.shards[n] if n in targeted else s for n, s in layout.shards.items()}
        merged = TrainerLayout(self.world_size, dict(layout.params), shards, kind=f"{layout.kind}+lora-merged",
                               description=f"{layout.description}, LoRA merged into {len(targeted)} weights")
        merged.validate()
        mine = [n for n in merged.shards_on(self.rank) if n not in targeted]
        sources = local_sources(self.view, mine, rank=self.rank, world_size=self.world_size)
        for n, t in targeted.items():
            start, end, part = self._bounds(t)
            if end > start:
                buf = self.staging.get(n)
                local = getattr(t.weight, "ds_tensor", t.weight)
                if buf is None or buf.device != local.device:
                    buf = self.staging[n] = torch.zeros(part, dtype=local.dtype, device=local.device)
                sources[n] = buf
        return merged, sources

    def _adapters(self) -> dict[str, torch.Tensor]:
        """Every adapter matrix whole (collective under ZeRO-3: one all_gather of this rank's
        partitions of all of them; below stage 3 they are whole already)."""
        mats = {f"{t.name}:{k}": p for t in self.targets for k, p in (("A", t.lora_a), ("B", t.lora_b))}
        parted = {k: p for k, p in mats.items() if hasattr(p, "ds_tensor")}
        out = {k: p.detach() for k, p in mats.items() if k not in parted}
        if not parted:
            return out
        import torch.distributed as dist

        parts = [p.ds_tensor.detach().reshape(-1) for p in parted.values()]
        device = parts[0].device
        if dist.get_backend() == "nccl" and device.type != "cuda":  # offloaded partitions: NCCL moves GPU memory
            device = torch.device("cuda", torch.cuda.current_device())
        dtypes = {x.dtype for x in parts}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # mixed: float32 holds each exactly
        mine = torch.cat([x.to(device=device, dtype=dtype) for x in parts])
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        off = 0
        for (k, p), x in zip(parted.items(), parts):
            full = torch.cat([e[off:off + x.numel()] for e in every])[:int(p.ds_numel)]
            out[k] = full.view(_shape(p)).to(p.ds_tensor.dtype)
            off += x.numel()
        return out

    def refresh(self) -> None:
        """Collective, on every rank, before every sync: the current adapters merged into this
        rank's slice of every targeted weight (the staging buffers :meth:`plan` handed out)."""
        mats = self._adapters()
        with torch.no_grad():
            for t in self.targets:
                start, end, _ = self._bounds(t)
                if end <= start:
                    continue
                shape = _shape(t.weight)
                if len(shape) != 2:
                    raise LayoutError(f"LoRA target {t.name!r} has shape {shape}, expected a 2-D Linear weight")
                local = t.weight.ds_tensor if hasattr(t.weight, "ds_tensor") else t.weight.detach().reshape(-1)
                base = local[:end - start] if hasattr(t.weight, "ds_tensor") else local[start:end]
                merged_slice(base, start, (shape[0], shape[1]), mats[f"{t.name}:A"], mats[f"{t.name}:B"], t.scaling,
                             self.staging[t.name])
