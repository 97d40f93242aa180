"""What one vLLM worker keeps between fastsync's ``collective_rpc`` calls, and the memory its
receivers land in: the worker's state record (:class:`WorkerState`), the saved state of a layer
whose post-load step is re-run (:class:`ModuleState`), and the three landings a receiver writes
into (in place with a snapshot, staged off the live model, in place with delta inboxes).

A leaf of the worker extension: it imports no other part of it, and the extension's operations
(``extension.py``, ``reload.py``) are functions and methods over these records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastsync.errors import ConfigError
from fastsync.executor.arena import carve
from fastsync.executor.staging import Landing
from fastsync.engines.vllm.layout import LiveParam
from fastsync.layout.types import EngineTensor
from fastsync.sync.delta_receiver import InboxLanding

__all__ = ["EngineDeltaLanding", "EngineLanding", "ModuleState", "StagedEngineLanding", "WorkerState",
           "check_staging_memory"]


class EngineLanding(Landing):
    """The receiver's ``inplace`` landing with a snapshot of only the parameters that are
    written in their live memory (``backup_names``). Staging tensors of prepacked parameters need
    none: the kernels' packed copies change only at the flip."""

    def __init__(self, tensors: dict[str, torch.Tensor], backup_names: list[str],
                 on_apply: Callable[[], None] | None = None, arena: torch.Tensor | None = None) -> None:
        super().__init__(tensors, mode="inplace", backup=False)
        self.on_apply = on_apply
        # the previous receiver's arena when large enough (already touched), else one touched now
        self._backup_arena, views = carve(arena, [(n, self.infos[n].nbytes) for n in backup_names])
        self._backup.update(views)
        self.backup = bool(backup_names)

    def apply(self, names: list[str] | None = None) -> None:
        """The flip's data step; then ``on_apply`` (the extension's post-processing), still
        inside ``WeightReceiver.finish``'s rollback scope: a SyncError raised there rolls the
        in-place parameters back and publishes the failure instead of the flip."""
        super().apply(names)
        if self.on_apply is not None:
            self.on_apply()


class StagedEngineLanding(EngineLanding):
    """Staged receive (``fastsync_connect(..., staged=True)``): every write lands off the live
    model, so the engine keeps generating on its version while the next one arrives. Prepacked
    parameters land in their staging tensors (as always); parameters the kernels read in place
    (embeddings, norms) land in a shadow arena. The flip (:meth:`apply`, the only part that needs
    the engine paused) snapshots those live parameters, copies the shadows in and runs the
    post-processing (repacks); if that fails, :meth:`rollback` puts the snapshot back."""

    def __init__(self, tensors: dict[str, torch.Tensor], shadow_names: list[str],
                 on_apply: Callable[[], None] | None = None, arena: torch.Tensor | None = None) -> None:
        Landing.__init__(self, tensors, mode="inplace", backup=False, shadow=shadow_names)
        self.on_apply = on_apply
        self.shadow_names = list(shadow_names)
        self._backup_arena, self._snap = carve(arena, [(n, self.infos[n].nbytes) for n in shadow_names])
        self.backup = False
        self._flipped = False

    def begin(self) -> None:
        self._flipped = False  # nothing live changes before the flip

    def apply(self, names: list[str] | None = None) -> None:
        from fastsync.executor.staging import as_bytes

        for n in self.shadow_names:  # the live bytes as they are, for a failed post-processing
            self._snap[n].copy_(as_bytes(self.live[n]))
        self._flipped = True
        Landing.apply(self, names)
        if self.on_apply is not None:
            self.on_apply()

    def rollback(self) -> bool:
        from fastsync.executor.staging import as_bytes

        if self._flipped:
            for n in self.shadow_names:
                as_bytes(self.live[n]).copy_(self._snap[n])
            self._flipped = False
        self.torn = False
        return True


class EngineDeltaLanding(InboxLanding, EngineLanding):
    """:class:`EngineLanding` plus the delta inboxes (``WeightSync(delta=True)``): a delta is
    written into the same live and staging tensors as a dense sync, the rollback copy covers
    exactly what it overwrote, and the same post-processing (repacks) runs before the flip."""

    def __init__(self, tensors: dict[str, torch.Tensor], backup_names: list[str],
                 on_apply: Callable[[], None] | None, inbox_bytes: dict[int, int],
                 arena: torch.Tensor | None = None) -> None:
        EngineLanding.__init__(self, tensors, backup_names, on_apply=on_apply, arena=arena)
        self.add_inboxes(inbox_bytes)


class WorkerState:
    """What one worker keeps between ``collective_rpc`` calls."""

    def __init__(self, rank: int, tp_rank: int, tp_size: int, live: dict[str, LiveParam],
                 expected: dict[str, EngineTensor]) -> None:
        self.rank = rank
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.live = live
        self.expected = expected
        self.staging: dict[str, torch.Tensor] = {}
        self.receiver: Any = None
        self.version = 0
        self.open: int | None = None
        self.last: dict = {}
        # module states replaced by the open version's post-processing, kept until the flip is
        # final so a failure anywhere before it can put the previous ones back
        self.undo: list[ModuleState] = []
        self.postprocess_s = 0.0
        self.postprocess_ns = 0  # when the last post-processing (repack) began, for a trace
        self.plain = False  # staging tensors hold the served version's bytes (a holder for peer reload)
        self.arenas: list[torch.Tensor] = []  # the staging arena(s), one NIXL registration each
        self.backup_arena: torch.Tensor | None = None  # the in-place snapshot's memory, reused by each receiver
        self.staged = False  # connected for staged receive (fastsync_stage / fastsync_flip)
        self.stage_thread: Any = None  # drives the open staged version's receive while the engine generates
        self.fallback: Any = None  # fallback.Fallback: checkpoint tensors vLLM's own loader takes at each flip
        self.fallback_s = 0.0


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


def check_staging_memory(st: WorkerState, dest: dict[str, torch.Tensor], shadow: list[str]) -> None:
    """Staged receive keeps a shadow of every in-place parameter and a snapshot at the flip: refuse
    at set-up, naming the option, when this host has not the memory for both."""
    need = 2 * sum(dest[n].numel() * dest[n].element_size() for n in shadow)
    try:
        import psutil  # a vLLM dependency

        avail = int(psutil.virtual_memory().available)
    except Exception:  # cannot tell: do not refuse
        return
    if need > avail:
        raise ConfigError(f"engine rank {st.rank}: staged=True needs {need} bytes for the shadow and flip copies of "
                          f"{len(shadow)} in-place parameters, {avail} bytes are available; use staged=False "
                          "(the engine then pauses for the whole transfer)")
