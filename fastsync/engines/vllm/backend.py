"""``fastsync`` as a backend of vLLM's own weight-transfer API (``vllm.distributed.weight_transfer``).

vLLM 0.32 picks a weight-transfer backend by name: the worker side from
``WeightTransferEngineFactory`` (``--weight-transfer-config '{"backend": "fastsync"}'`` or
``LLM(weight_transfer_config=...)``), the trainer side from ``WeightTransferTrainerFactory``
(dispatching on ``TrainerInitInfo.backend``). :func:`register_weight_transfer` puts fastsync's two
engines in both registries, by module path (vLLM imports them only when the backend is chosen).

It runs in every vLLM process through fastsync's ``vllm.general_plugins`` entry point
(``fastsync_weight_transfer`` in pyproject.toml), and in a trainer process when
``fastsync.engines.vllm.weight_transfer_trainer`` is imported (where the trainer gets
``FastSyncTrainerInitInfo`` from), so neither side needs a call of its own. vLLM loads general
plugins more than once per process: registering again is a no-op.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND", "register_weight_transfer"]

log = logging.getLogger(__name__)

#: the name in ``--weight-transfer-config '{"backend": ...}'`` and ``TrainerInitInfo.backend``
BACKEND = "fastsync"

_WORKER = ("fastsync.engines.vllm.weight_transfer", "FastSyncWeightTransferEngine")
_TRAINER = ("fastsync.engines.vllm.weight_transfer_trainer", "FastSyncTrainerWeightTransferEngine")


def register_weight_transfer() -> bool:
    """Register the ``fastsync`` worker and trainer engines with vLLM's factories (idempotent).

    Returns True when both are registered under :data:`BACKEND` (by this call or an earlier one),
    False where vLLM or its weight-transfer API is not installed. A backend named ``fastsync``
    that some other plugin registered first is left in place, with a warning: vLLM's registry
    refuses a second registration under one name.
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return False
    for factory, (module, cls) in ((WeightTransferEngineFactory, _WORKER), (WeightTransferTrainerFactory, _TRAINER)):
        registry = getattr(factory, "_registry", {})
        if BACKEND in registry:
            if getattr(registry[BACKEND], "_fastsync", None) != (module, cls):
                log.warning("vLLM weight-transfer backend %r is already registered by another plugin in %s; "
                            "fastsync's %s.%s was not registered", BACKEND, factory.__name__, module, cls)
            continue
        factory.register_engine(BACKEND, module, cls)
        registry[BACKEND]._fastsync = (module, cls)  # marks our own loader, so a re-run is silent
    return True
