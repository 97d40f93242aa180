"""What one vLLM worker keeps between fastsync's ``collective_rpc`` calls about its model: the
worker's state record (:class:`WorkerState`: live parameters, engine tensors, staging memory, the
fallback buffers) and the saved state of a layer whose post-load step is re-run
(:class:`ModuleState`). The session state (receiver, versions, snapshot) is the engine session's
(``fastsync.sync.engine_session``); the landings are ``fastsync.sync.engine_landing``'s.

A leaf of the worker extension: it imports no other part of it.
"""

from __future__ import annotations

from typing import Any

import torch

from fastsync.engines.vllm.layout import LiveParam
from fastsync.layout.types import EngineTensor
from fastsync.sync.engine_landing import EngineLanding  # noqa: F401 - fastsync.engines.vllm.EngineLanding

__all__ = ["ModuleState", "WorkerState"]


class WorkerState:
    """What one worker keeps about its model between ``collective_rpc`` calls."""

    def __init__(self, rank: int, tp_rank: int, tp_size: int, live: dict[str, LiveParam],
                 expected: dict[str, EngineTensor]) -> None:
        self.rank = rank
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.live = live
        self.expected = expected
        self.staging: dict[str, torch.Tensor] = {}
        self.plain = False  # staging tensors hold the served version's bytes (a holder for peer reload)
        self.arenas: list[torch.Tensor] = []  # the staging arena(s), one NIXL registration each
        self.fallback: Any = None  # fallback.Fallback: checkpoint tensors vLLM's own loader takes at each flip


class ModuleState:
    """What a layer's post-load step replaces (``cpu_linear``, the parameter objects and their
    data), saved before it runs so the layer can be put back exactly as it was."""

    _MISSING = object()

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.cpu_linear = module.__dict__.get("cpu_linear", self._MISSING)
        self.params = dict(module._parameters)
        self.data = {n: p.data for n, p in self.params.items() if p is not None}

    def restore(self) -> None:
        m = self.module
        if self.cpu_linear is self._MISSING:
            m.__dict__.pop("cpu_linear", None)
        else:
            m.cpu_linear = self.cpu_linear
        m._parameters.clear()
        m._parameters.update(self.params)
        for n, d in self.data.items():
            self.params[n].data = d
