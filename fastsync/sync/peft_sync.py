"""``WeightSync`` over a PEFT model: the base weights when they change, the adapter every version.

``WeightSync(peft_model, ...)`` (or ``lora=True``) builds a :class:`PeftWeightSync`. It is two
syncs over the same engines: the dense :class:`~fastsync.sync.weight_sync.WeightSync` over a view
of the base model (the PEFT model's own base parameters, no copy, under the names the checkpoint
has: ``...q_proj.base_layer.weight`` -> ``...q_proj.weight``), and a
:class:`~fastsync.sync.lora_sync.LoraSync` for the adapter (into a spare LoRA slot of each engine,
flipped per version). The base goes with the first :meth:`PeftWeightSync.sync` and again whenever
``sync(version, base=True)`` says it changed; every sync writes the adapter. Engines must be
started with LoRA enabled (vLLM: ``enable_lora=True``, ``max_loras`` >= 2, ``max_lora_rank`` >= r)
and their handles must offer ``lora()`` (``fastsync.engines.vllm.handle.VllmEngine`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastsync.errors import ConfigError
from fastsync.sync.lora_sync import LoraSync, LoraSyncResult
from fastsync.sync.weight_sync import SyncResult, WeightSync

__all__ = ["PeftWeightSync", "PeftSyncResult", "base_view", "is_peft_model"]

#: name parts of PEFT's own parameters (adapter matrices, DoRA magnitudes, prompt encoders): left out
_ADAPTER_PARTS = (".lora_", ".prompt_encoder.")
#: name parts of PEFT's modules_to_save copies: refused (the base view cannot stand for them)
_SAVED_PARTS = (".modules_to_save.", ".original_module.")


def is_peft_model(model: Any) -> bool:
    """A PEFT ``PeftModel`` (duck-typed: no peft import in the core)."""
    return model is not None and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_view(peft_model: Any) -> torch.nn.Module:
    """A module whose parameters are the PEFT model's base parameters themselves (no copy; an
    optimizer step on the base shows through), named as the base checkpoint names them.
    ConfigError naming the parameter for what a base sync cannot stand for (``modules_to_save``)."""
    base = peft_model.get_base_model()
    root = torch.nn.Module()
    for name, p in base.named_parameters():
        if any(part in f".{name}" for part in _SAVED_PARTS):
            raise ConfigError(f"PEFT parameter {name!r}: modules_to_save are not supported by the LoRA sync "
                              "(sync a merged model with WeightSync(model.merge_and_unload()) instead)")
        if any(part in f".{name}" for part in _ADAPTER_PARTS):
            continue
        *path, leaf = name.replace(".base_layer.", ".").split(".")
        m = root
        for part in path:
            child = getattr(m, part, None)
            if child is None:
                child = torch.nn.Module()
                m.add_module(part, child)
            m = child
        m.register_parameter(leaf, p)
    return root


@dataclass(slots=True)
class PeftSyncResult:
    """One version: ``base`` when the base went with it (else None), ``adapter`` always."""

    version: int
    base: SyncResult | None
    adapter: LoraSyncResult

    @property
    def seconds(self) -> float:
        return self.adapter.seconds + (self.base.seconds if self.base is not None else 0.0)


class PeftWeightSync(WeightSync):
    """What ``WeightSync(peft_model, ...)`` returns. Same arguments as WeightSync, plus
    ``adapter`` (the PEFT adapter name, ``"default"``).

    Example::

        pm = get_peft_model(base, LoraConfig(r=16, target_modules=[...]))
        ws = WeightSync(pm, rank=rank, world_size=world, control=control, engines=engines)
        ws.setup()
        for step in range(1, n + 1):
            ...; optimizer.step()
            ws.sync(step)                     # the base with the first, the adapter every time
            llm.generate(prompts, params, lora_request=ws.lora_request())
    """

    @classmethod
    def takes(cls, model: Any, kwargs: dict) -> bool:
        """``WeightSync(...)`` builds this class for a PEFT model, unless ``lora=False``; and for ``lora=True``."""
        lora = kwargs.get("lora")
        return bool(lora) or (lora is None and is_peft_model(model))

    def __init__(self, model: Any = None, *, adapter: str = "default", lora: bool | None = True,
                 **kwargs: Any) -> None:
        if not is_peft_model(model):
            raise ConfigError(f"WeightSync(lora=True) needs a PEFT model (get_peft_model(...)), got "
                              f"{type(model).__name__}")
        if adapter not in model.peft_config:
            raise ConfigError(f"PEFT adapter {adapter!r} not in the model's adapters {sorted(model.peft_config)}")
        if kwargs.get("delta") or kwargs.get("fanout", "off") != "off":
            raise ConfigError("WeightSync over a PEFT model: delta= and fanout= are not supported with LoRA")
        super().__init__(base_view(model), **kwargs)
        self.peft_model = model
        lora_engines = []
        for i, h in enumerate(self.engines):
            make = getattr(h, "lora", None)
            if make is None:
                raise ConfigError(f"engine handle {i} ({type(h).__name__}) has no lora(): it cannot take adapters")
            lora_engines.append(make())
        self.lora = LoraSync(model, control=self.control, rank=self.rank, world_size=self.world_size,
                             engines=lora_engines, transport=self.transport, timeout_s=self.timeout_s,
                             adapter=adapter, control_port=self.control_port, name=f"{self.name}-lora")
        self._base_sent = False

    def setup(self) -> None:
        """The base's plan and the adapter's (LayoutError before any write when they disagree)."""
        super().setup()
        self.lora.setup()

    def sync(self, version: int, *, timeout_s: float | None = None,  # type: ignore[override]
             base: bool = False) -> PeftSyncResult:
        """Every trainer rank. The base first when it has not been sent or ``base=True`` (the
        engines then serve the base of ``version``), then the adapter of ``version``."""
        base_result = None
        if base or not self._base_sent:
            base_result = super().sync(version, timeout_s=timeout_s)
            self._base_sent = True
        adapter = self.lora.sync(version, timeout_s=timeout_s)
        return PeftSyncResult(version, base_result, adapter)

    def lora_request(self, engine: int = 0, version: int | None = None) -> Any:
        """The engine's request object naming the adapter version it serves (vLLM: ``LoRARequest``)."""
        return self.lora.engines[engine].request(version)

    def version_of(self, output: Any, engine: int = 0) -> int | None:
        """The adapter version a finished request ran on (vLLM: from ``RequestOutput.lora_request``)."""
        return self.lora.engines[engine].version_of(output)

    def close(self) -> None:
        try:
            self.lora.close()
        finally:
            super().close()


WeightSync.variants.append(PeftWeightSync)
