"""A PEFT LoRA actor's FSDP2 shards with the adapter merged locally (verl's
``actor_rollout_ref.model.lora.merge=True``), so the merged weights go in place without any rank
gathering a base weight.

What verl does on that setting (0.9.1, ``FSDPEngine._merged_lora_per_tensor_param``): inside
``merged_lora_context`` it merges every LoRA layer into its base weight (PEFT's ``merge``:
``W += (B @ A) * scaling``, FSDP2 unsharding layer by layer), names the state dict with
``normalize_peft_param_name`` (``base_model.model.`` and ``.base_layer`` dropped, every ``lora_``
tensor left out) and ``convert_weight_keys``, and yields ``full_tensor()`` of every parameter on
every rank. The rollout (vLLM without LoRA: verl's server sets no ``enable_lora`` when merging)
loads those base names.

Here each trainer rank sends its own FSDP2 shard of each base weight, merged locally. For a
LoRA-targeted ``nn.Linear`` whose shard holds rows ``r0:r1`` and columns ``c0:c1`` of ``W``
(FSDP2: ``Shard(0)``, ``torch.chunk`` bounds, uneven at the end)::

    merged_shard = W_shard + (B[r0:r1] @ A[:, c0:c1]) * scaling     # per active adapter, in order

``A`` (r x in) is gathered (small); ``B``'s own local rows serve where FSDP2 split ``B`` along
the same row bounds as ``W`` (it does: both have ``out`` rows on dim 0), else ``B`` is gathered
too. ``scaling`` is PEFT's own per-layer value (``lora_alpha / r``, ``lora_alpha / sqrt(r)``
with ``use_rslora``, ``alpha_pattern`` / ``rank_pattern`` applied); dropout plays no part in a
merge. The gathers are collectives, so every rank walks every LoRA layer in the same order,
holding a shard of its ``W`` or not. Names, shapes and dtypes are the base weights': the
trainer's parameter dtype (verl's export casts to bfloat16; the engine casts on landing).

What a local merge cannot stand for is refused by name (:func:`lora_refusal`): DoRA and other
LoRA variants, ``lora_bias``, ``fan_in_fan_out`` (Conv1D), LoRA on layers other than
``nn.Linear`` (embeddings, convolutions, parameter targets), ``modules_to_save`` / trainable
tokens, PEFT methods other than LoRA, adapters already merged.
"""

from __future__ import annotations

from typing import Any

import torch

from fastsync import ConfigError, copy_local_shards, lora_config_refusal, lora_delta, trainer_layout_from_module

__all__ = ["MergedShards", "lora_refusal"]


def _unsupported_layer(name: str, m: Any, lora_linear: type) -> str | None:
    """Why PEFT layer ``m`` (at ``name``) cannot be merged into its local shard, or None."""
    if type(m) is not lora_linear:
        return (f"PEFT layer {name!r} is a {type(m).__module__}.{type(m).__name__} (only LoRA on torch.nn.Linear "
                "merges into a row shard here)")
    if m.fan_in_fan_out:
        return f"LoRA layer {name!r} has fan_in_fan_out=True (a Conv1D base layer stores W transposed)"
    if m.merged:
        return f"LoRA layer {name!r} already has adapters {m.merged_adapters} merged into its base weight"
    for ad in _adapters(m):
        if ad in m.lora_variant or m.use_dora.get(ad):
            what = "DoRA (use_dora=True)" if m.use_dora.get(ad) else f"LoRA variant {type(m.lora_variant[ad]).__name__}"
            return f"LoRA layer {name!r}, adapter {ad!r}: {what} (its merge is not W + scaling * B @ A)"
        if m.lora_bias.get(ad):
            return f"LoRA layer {name!r}, adapter {ad!r}: lora_bias=True (the merge also changes the base bias)"
    if m.get_base_layer().weight.dim() != 2:
        return f"LoRA layer {name!r}: base weight is not 2-D"
    return None


def _adapters(m: Any) -> list[str]:
    """The adapters PEFT's ``merge()`` would merge into ``m``: its active ones that it holds."""
    return [a for a in m.active_adapters if a in m.lora_A]


def lora_refusal(peft_model: Any) -> str | None:
    """Why a PEFT model's FSDP2 shards cannot be sent with the LoRA adapter merged locally, or
    None. Names the PEFT type, module and adapter that cannot be merged shard by shard."""
    from peft import LoraConfig
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    refused = [why for ad, cfg in peft_model.peft_config.items()  # fastsync's rule for any merged LoRA sync
               if (why := lora_config_refusal(cfg, ad)) is not None and not isinstance(cfg, LoraConfig)]
    if refused:  # a PEFT method other than LoRA
        return refused[0]
    for name, m in peft_model.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper):
            return (f"PEFT module {name!r} is a {type(m).__name__} (modules_to_save / trainable tokens: a trained "
                    "copy of the base module, not a delta on it)")
        if isinstance(m, BaseTunerLayer):
            why = _unsupported_layer(name, m, LoraLinear)
            if why is not None:
                return why
    for ad, cfg in peft_model.peft_config.items():  # settings no single layer shows (layer_replication, ...)
        why = lora_config_refusal(cfg, ad)
        if why is not None:
            return why
    return None


class _Layer:
    """One LoRA-targeted Linear: its base weight's state-dict name (normalized) and the module."""

    __slots__ = ("name", "module")

    def __init__(self, name: str, module: Any) -> None:
        self.name, self.module = name, module


class _State:
    """A state dict standing in for a module where ``copy_local_shards`` reads one."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self, keep_vars: bool = True) -> dict[str, Any]:
        return self.state


class MergedShards:
    """The base weights of an FSDP2-sharded PEFT LoRA model under verl's merged-export names,
    read from local shards, each LoRA-targeted weight merged with its adapter on this rank.

    Stands where the FSDP2 module stands for the trainer end: :meth:`state_dict` (the layout
    reads placements from it), :meth:`hf_names`, and :meth:`copy_local` (before every sync;
    every trainer rank calls it, as it gathers the adapters' ``A``).

    Example (verl calls ``get_per_tensor_param()`` after ``optimizer.step()``; fastsync's
    backend, every rank)::

        shards = MergedShards(fsdp_peft_module, rank, num_trainers)
        layout, local = renamed_shard_layout(shards, rank, num_trainers, shards.hf_names(), description=...)
        shards.copy_local(local, sources)      # each sync, after the step
    """

    def __init__(self, peft_model: Any, rank: int, world_size: int) -> None:
        from peft.tuners.lora import Linear as LoraLinear

        why = lora_refusal(peft_model)
        if why is not None:
            raise ConfigError(f"fastsync trainer rank {rank}: cannot merge the LoRA adapter shard by shard: {why}")
        self.model, self.rank = peft_model, rank
        self.adapter_gathered_bytes = 0  # what the last copy_local gathered (the adapters' A, B where needed)
        self.layers: list[_Layer] = []
        for name, m in peft_model.named_modules():
            if type(m) is LoraLinear and _adapters(m):
                (base,) = self._normalize({f"{name}.base_layer.weight": None})
                self.layers.append(_Layer(base, m))
        # every rank's box of each merged W and each B, from their placements (the same on every rank)
        state = self.state_dict()
        parts = {layer.name: state[layer.name] for layer in self.layers}
        parts.update({f"{layer.name}|B|{ad}": layer.module.lora_B[ad].weight
                      for layer in self.layers for ad in _adapters(layer.module)})
        self.boxes = trainer_layout_from_module(_State(parts), rank, world_size).shards

    @staticmethod
    def _normalize(state: dict[str, Any]) -> dict[str, Any]:
        from verl.utils.fsdp_utils import normalize_peft_param_name

        return normalize_peft_param_name(state)

    def state_dict(self, keep_vars: bool = True) -> dict[str, Any]:
        """The base weights (DTensors) under verl's normalized names, the adapter's tensors left out."""
        return self._normalize(self.model.state_dict(keep_vars=True))

    def hf_names(self) -> dict[str, str]:
        """Normalized state-dict name -> the name verl's merged export sends (``convert_weight_keys``)."""
        from verl.utils.model import convert_weight_keys

        keys = list(self.state_dict())
        renamed = list(convert_weight_keys(dict.fromkeys(keys, 0), self.model).keys())
        if len(renamed) != len(keys):
            raise ConfigError("verl's convert_weight_keys merged parameter names; fastsync cannot map shards")
        return dict(zip(keys, renamed))

    def _aligned(self, w_name: str, b_name: str, num_cols: int) -> bool:
        """B's local rows are W's local rows on every rank (FSDP2 splits both on dim 0, the
        ``out`` rows), each with all of B's columns."""
        w = {s.rank: s.box[0] for s in self.boxes[w_name]}
        b = {s.rank: s.box for s in self.boxes[b_name]}
        return set(b) == set(w) and all(b[r][0] == rows and b[r][1] == (0, num_cols) for r, rows in w.items())

    @torch.no_grad()
    def copy_local(self, local_names: dict[str, str], sources: dict[str, torch.Tensor]) -> None:
        """Copy this rank's base shards into ``sources`` (by host name), then add each LoRA layer's
        delta rows in place, adapter by adapter as PEFT's ``merge`` adds them. Collective: every
        trainer rank calls it (the adapters' A, and B where its rows are not W's, are gathered)."""
        copy_local_shards(_State(self.state_dict()), local_names, sources, self.rank)
        where = {sd: hf for hf, sd in local_names.items()}
        gathered = 0
        for layer in self.layers:  # the same order on every rank: the gathers below are collectives
            mine = [s.box for s in self.boxes[layer.name] if s.rank == self.rank]
            for ad in _adapters(layer.module):
                a_w, b_w = layer.module.lora_A[ad].weight, layer.module.lora_B[ad].weight
                a, n = _whole(a_w)
                gathered += n
                aligned = self._aligned(layer.name, f"{layer.name}|B|{ad}", b_w.shape[1])
                if aligned:
                    b = b_w.to_local() if _is_dtensor(b_w) else b_w.detach()
                else:
                    b, n = _whole(b_w)
                    gathered += n
                if layer.name not in where or not mine:
                    continue  # no shard of W here; the gathers above still had to run
                (r0, r1), (c0, c1) = mine[0]
                dst = sources[where[layer.name]]
                delta = lora_delta(b if aligned else b[r0:r1], a[:, c0:c1], layer.module.scaling[ad])
                dst.add_(delta)  # in W's dtype, as PEFT's W.data += delta
        self.adapter_gathered_bytes = gathered


def _whole(t: Any) -> tuple[torch.Tensor, int]:
    """All of a small adapter tensor on every rank (a collective for a DTensor) and the bytes gathered."""
    if not _is_dtensor(t):
        return t.detach(), 0
    from torch.distributed.tensor import Replicate

    full = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()
    return full, full.nbytes


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
