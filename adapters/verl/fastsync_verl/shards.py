"""Trainer ranks hand fastsync their local FSDP2 shards instead of verl's full tensors.

verl's actor worker syncs with ``engine.get_per_tensor_param()`` and passes the result to the
checkpoint engine's ``send_weights``. For FSDP2 that result is a *lazy* generator: each
``full_tensor()`` (an all-gather of the parameter on every trainer rank) runs only when the
generator is iterated. :func:`install` wraps ``FSDPEngine.get_per_tensor_param`` (verl's hook
point, in the actor's process, when verl imports ``fastsync_verl`` through
``checkpoint_engine.custom_backend_module``) so the result is a :class:`ShardedWeights`: it
iterates exactly like verl's generator (any other backend sees no difference) and also carries the
FSDP2 module. fastsync's backend then reads each parameter's DTensor placement and local shard and
never iterates it: no ``full_tensor()`` on any rank.

A PEFT LoRA actor whose export verl merges (``actor_rollout_ref.model.lora.merge=True``: the
checkpoint-engine call then returns verl's merged full tensors and no ``peft_config``) goes from
its shards too, each rank merging the adapter into its own rows of every LoRA-targeted weight
(``fastsync_verl.lora_merge``); an unmerged LoRA actor is refused (:class:`AdapterDropped`).

Where the shards cannot serve (FSDP1, LoRA layers a local merge cannot stand for, QAT, a parameter that is not
Shard(d)/Replicate), :meth:`ShardedWeights.refusal` says why and the backend falls back to
iterating the full tensors (logged), or raises if ``engine_kwargs.fastsync.trainer_shards`` is
``"on"``.

MoE models with transformers v5's packed experts (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) go in place from their shards: FSDP2 splits the expert
dimension, and the engine's plan (recorded from vLLM's own loader, which is fed the packed
tensor or its per-expert views) maps each trainer rank's experts straight into vLLM's fused-MoE
weights (``w13_weight``, ``w2_weight``). The un-fusing verl does on export
(``unfuse_moe_params``) is layout there, never materialised. Only the *full-copy* path, where
verl's own loader takes named tensors on the rollout side, needs verl's un-fused names:
:meth:`ShardedWeights.full_copy_refusal` says so and that path iterates verl's full tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from fastsync import ConfigError, resolve_hook_point, wrap_hook_point
from fastsync_verl.lora_merge import lora_refusal

__all__ = ["ShardedWeights", "AdapterDropped", "install", "SUPPORTED_VERL"]

log = logging.getLogger("fastsync_verl")

#: verl releases whose hook point (``FSDPEngine.get_per_tensor_param`` returning a lazy generator
#: over ``module.state_dict()``) this module was written against.
SUPPORTED_VERL = ("0.9",)

_FSDP = "verl.workers.engine.fsdp.transformer_impl"


class ShardedWeights:
    """verl's lazy full-tensor generator plus the FSDP2 module it would gather from."""

    def __init__(self, full: Any, module: Any, *, refusal: str | None = None,
                 packed_experts: str | None = None, lora_merged: bool = False) -> None:
        self._full = full
        self.module = module
        self._refusal = refusal
        self._packed = packed_experts
        #: a PEFT LoRA actor whose export verl merges (lora.merge=True): the shards go with the
        #: adapter merged locally (``fastsync_verl.lora_merge.MergedShards``)
        self.lora_merged = lora_merged
        self.iterated = False  # True once anything asked for the full tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.iterated = True
        return iter(self._full)

    def refusal(self) -> str | None:
        """Why the local shards cannot stand in for the full tensors, or None."""
        if self._refusal is not None:
            return self._refusal
        from torch.distributed.tensor import DTensor, Replicate, Shard

        for name, t in self.module.state_dict(keep_vars=True).items():
            if isinstance(t, DTensor) and not all(type(p) is Shard or isinstance(p, Replicate) for p in t.placements):
                return f"parameter {name!r} has placements {t.placements} (only Shard(d)/Replicate are boxes)"
        return None

    def full_copy_refusal(self) -> str | None:
        """Why the shards cannot feed the full-copy path (verl's loader on the rollout side takes
        its un-fused expert names), or None. The in-place path plans packed experts as they are."""
        return self._packed

    def hf_names(self) -> dict[str, str]:
        """state_dict name -> the HF name verl would send (``convert_weight_keys``)."""
        from verl.utils.model import convert_weight_keys

        keys = list(self.module.state_dict(keep_vars=True).keys())
        inner = getattr(self.module, "_fsdp_wrapped_module", self.module)
        renamed = list(convert_weight_keys(dict.fromkeys(keys, 0), inner).keys())
        if len(renamed) != len(keys):
            raise ConfigError("verl's convert_weight_keys merged parameter names; fastsync cannot map shards")
        return dict(zip(keys, renamed))


class AdapterDropped:
    """verl's export of an *unmerged* LoRA actor for a checkpoint engine: the base weights only.

    verl 0.9's ``ActorRolloutRefWorker.update_weights`` calls ``get_per_tensor_param()`` (no
    arguments: ``base_sync_done=False``) for every checkpoint-engine backend and drops the
    ``peft_config`` it returns; for a PEFT actor that is the base model without the adapter
    (``collect_lora_params`` skips every ``lora_`` tensor). Whatever backend sends it, the rollout
    serves the untrained base. Iterates exactly like verl's generator; fastsync's backend refuses
    it by name (:meth:`refusal`) before any byte moves."""

    def __init__(self, full: Any, peft_config: Any) -> None:
        self._full = full
        self.peft_config = peft_config

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._full)

    def refusal(self, rank: int) -> str:
        pc = self.peft_config  # verl hands PEFT's LoraConfig as a dict (asdict)
        r = pc.get("r", "?") if isinstance(pc, dict) else getattr(pc, "r", "?")
        return (f"fastsync trainer rank {rank}: the actor is a LoRA model (r={r}, not merged) and verl's "
                "checkpoint-engine path hands over its base weights without the adapter (verl 0.9: "
                "update_weights calls get_per_tensor_param() with base_sync_done=False and drops peft_config), "
                "so the rollout would never see the trained adapter. Set actor_rollout_ref.model.lora.merge=True "
                "(each FSDP2 rank then sends its own shards with the adapter merged locally: fastsync_verl.lora_merge; "
                "LoRA layers a local merge cannot stand for take verl's merged full tensors), or run "
                "fastsync's WeightSync(peft_model) / LoraSync, which syncs the adapter into the engines' LoRA slots")


def _why_not(engine: Any, module: Any) -> str | None:
    from verl.utils.fsdp_utils import fsdp_version

    if fsdp_version(module) != 2:
        return f"FSDP{fsdp_version(module)} module (local shards are DTensors only with FSDP2)"
    inner = getattr(module, "_fsdp_wrapped_module", module)
    if hasattr(inner, "peft_config"):  # verl's merged export (lora.merge=True): merged shard by shard
        why = lora_refusal(inner)
        if why is not None:
            return f"LoRA adapters that cannot be merged into the local shards: {why}"
    if getattr(engine, "_qat_enabled", False):
        return "QAT is enabled (verl quantises the full tensors on export)"
    return None


def _packed_experts(engine: Any, module: Any) -> str | None:
    """Why verl's export renames this model's tensors (packed MoE experts it un-fuses), or None."""
    model_config = getattr(engine, "model_config", None)
    hf = getattr(model_config, "hf_config", None)
    if hf is None or not any(getattr(hf, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    packed = [n for n, t in module.state_dict(keep_vars=True).items()
              if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and t.dim() == 3]
    if not packed or getattr(hf, "model_type", None) == "gpt_oss":  # verl keeps GPT-OSS's packed tensors
        return None
    return (f"MoE model {getattr(hf, 'model_type', '?')!r}: verl un-fuses its {len(packed)} packed expert "
            f"tensor(s) (e.g. {packed[0]!r}) on export for its loader (unfuse_moe_params); the in-place path "
            "plans them as they are, the full-copy path takes verl's full tensors")


def install() -> None:
    """Wrap verl's ``FSDPEngine.get_per_tensor_param`` (idempotent). Raises HookPointError naming
    the attribute and the supported verl versions when the hook point is not where it was."""
    import verl

    engine = resolve_hook_point(_FSDP, "FSDPEngine", adapter="fastsync_verl", dist="verl",
                     supported=[v + ".x" for v in SUPPORTED_VERL])
    version = getattr(verl, "__version__", "?")
    if not any(str(version).startswith(v) for v in SUPPORTED_VERL):
        log.warning("fastsync_verl: verl %s is not a supported version (%s); trainer shards hook installed anyway",
                    version, ", ".join(SUPPORTED_VERL))

    def make(orig: Any) -> Any:
        def get_per_tensor_param(self, *args: Any, **kwargs: Any):
            full, peft = orig(self, *args, **kwargs)
            if peft is not None and not args and not kwargs:  # the checkpoint-engine call: base only
                return AdapterDropped(full, peft), peft
            if peft is not None or kwargs.get("layered_summon") or args:
                return full, peft  # adapter paths: verl's own tensors, untouched
            lora = hasattr(getattr(self.module, "_fsdp_wrapped_module", self.module), "peft_config")
            return ShardedWeights(full, self.module, refusal=_why_not(self, self.module),
                                  packed_experts=_packed_experts(self, self.module), lora_merged=lora), peft

        return get_per_tensor_param

    wrap_hook_point(engine, "get_per_tensor_param", make, who="fastsync_verl")
