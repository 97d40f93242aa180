"""MoE switch for verl: ``actor_rollout_ref.model.external_lib=fastsync_verl.moe``.

verl imports ``model.external_lib`` in every process that builds an ``HFModelConfig``
(``HFModelConfig.__post_init__`` -> ``import_external_libs``), which is before the training
engine builds its module. Importing this module wraps verl's FSDP engine
``FSDPEngine._build_module`` (inherited by the registered ``fsdp``/``fsdp2`` language-model
engines, ``FSDPEngineWithLMHead``): after verl loads the HF module, and before LoRA, FSDP
wrapping and the optimizer, it calls ``fastsync.patch_moe(module)``, swapping the HF v5 MoE
blocks for fastsync's grouped-GEMM blocks. Dense models pass through unchanged.

Without expert parallelism (``ep_group=None``): verl's FSDP shards the swapped experts like any
other parameter, and the exported names/shapes stay the HF ones, so weight sync is unaffected.
Use :func:`install` to pick another backend programmatically (e.g. in a custom entry point).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from fastsync import MOE_BACKENDS, ConfigError, patch_moe, unwrap_hook_point, wrap_hook_point

__all__ = ["install", "uninstall", "installed_backend"]

log = logging.getLogger(__name__)

_state: dict[str, str | None] = {"backend": None}


def _wrap(original: Callable) -> Callable:
    def _build_module(self: FSDPEngine):  # type: ignore[no-untyped-def]
        module = original(self)
        backend = _state["backend"]
        if backend is None or getattr(self.model_config, "model_type", None) != "language_model":
            return module
        swapped = patch_moe(module, ep_group=None, backend=backend)
        log.info("fastsync_verl.moe: swapped %d MoE block(s) (%s backend)", len(swapped), backend)
        return module

    return _build_module


def install(backend: str = "auto") -> None:
    """Make verl's FSDP engine swap MoE blocks after ``_build_module`` (idempotent; the last
    call's backend wins)."""
    if backend not in MOE_BACKENDS:
        raise ConfigError(f"fastsync_verl.moe: backend must be one of {MOE_BACKENDS}, got {backend!r}")
    _state["backend"] = backend
    wrap_hook_point(FSDPEngine, "_build_module", _wrap, who="fastsync_verl.moe")


def uninstall() -> None:
    """Restore verl's own ``_build_module``."""
    _state["backend"] = None
    unwrap_hook_point(FSDPEngine, "_build_module")


def installed_backend() -> str | None:
    return _state["backend"]


install()
