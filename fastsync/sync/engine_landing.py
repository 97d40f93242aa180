"""The memory an engine rank's receiver lands in, for any engine: in place with a snapshot
(:class:`EngineLanding`), staged off the live model (:class:`StagedEngineLanding`), in place with
delta inboxes (:class:`EngineDeltaLanding`), and the check that a host has the memory a staged
receive needs (:func:`check_staging_memory`).

Each landing runs the engine's flip hook (``on_apply``: the binding's repack/post-processing, see
``fastsync.sync.engine_session``) right after its data step, still inside
``WeightReceiver.finish``'s rollback scope. Built by :class:`~fastsync.sync.engine_session.EngineSession`
from what the engine's binding says its destinations are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastsync.errors import ConfigError
from fastsync.executor.arena import carve
from fastsync.executor.staging import Landing, as_bytes
from fastsync.sync.delta_receiver import InboxLanding

__all__ = ["EngineDeltaLanding", "EngineLanding", "StagedEngineLanding", "check_staging_memory"]


class EngineLanding(Landing):
    """The receiver's ``inplace`` landing with a snapshot of only the parameters that are
    written in their live memory (``backup_names``). Staging tensors of prepacked parameters need
    none: the kernels' packed copies change only at the flip."""

    def __init__(self, tensors: dict[str, torch.Tensor], backup_names: list[str],
                 on_apply: Callable[[], None] | None = None, arena: torch.Tensor | None = None) -> None:
        super().__init__(tensors, mode="inplace", backup=False)
        self.on_apply = on_apply
        # the previous receiver's arena when large enough (already touched), else one touched now;
        # the session keeps it for the next receiver
        self.backup_arena, views = carve(arena, [(n, self.infos[n].nbytes) for n in backup_names])
        self._backup.update(views)
        self.backup = bool(backup_names)

    def apply(self, names: list[str] | None = None) -> None:
        """The flip's data step; then ``on_apply`` (the engine's post-processing), still
        inside ``WeightReceiver.finish``'s rollback scope: a SyncError raised there rolls the
        in-place parameters back and publishes the failure instead of the flip."""
        super().apply(names)
        if self.on_apply is not None:
            self.on_apply()


class StagedEngineLanding(EngineLanding):
    """Staged receive (``connect(..., staged=True)``): every write lands off the live model, so
    the engine keeps generating on its version while the next one arrives. Prepacked parameters
    land in their staging tensors (as always); parameters the kernels read in place (embeddings,
    norms) land in a shadow arena. The flip (:meth:`apply`, the only part that needs the engine
    paused) snapshots those live parameters, copies the shadows in and runs the post-processing
    (repacks); if that fails, :meth:`rollback` puts the snapshot back."""

    def __init__(self, tensors: dict[str, torch.Tensor], shadow_names: list[str],
                 on_apply: Callable[[], None] | None = None, arena: torch.Tensor | None = None) -> None:
        Landing.__init__(self, tensors, mode="inplace", backup=False, shadow=shadow_names)
        self.on_apply = on_apply
        self.shadow_names = list(shadow_names)
        self.backup_arena, self._snap = carve(arena, [(n, self.infos[n].nbytes) for n in shadow_names])
        self.backup = False
        self._flipped = False

    def begin(self) -> None:
        self._flipped = False  # nothing live changes before the flip

    def apply(self, names: list[str] | None = None) -> None:
        for n in self.shadow_names:  # the live bytes as they are, for a failed post-processing
            self._snap[n].copy_(as_bytes(self.live[n]))
        self._flipped = True
        Landing.apply(self, names)
        if self.on_apply is not None:
            self.on_apply()

    def rollback(self) -> bool:
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


def check_staging_memory(rank: int, dest: dict[str, torch.Tensor], shadow: list[str]) -> None:
    """Staged receive keeps a shadow of every in-place parameter and a snapshot at the flip: refuse
    at set-up, naming the option, when this host has not the memory for both."""
    need = 2 * sum(dest[n].numel() * dest[n].element_size() for n in shadow)
    try:
        import psutil  # a vLLM dependency

        avail = int(psutil.virtual_memory().available)
    except Exception:  # cannot tell: do not refuse
        return
    if need > avail:
        raise ConfigError(f"engine rank {rank}: staged=True needs {need} bytes for the shadow and flip copies of "
                          f"{len(shadow)} in-place parameters, {avail} bytes are available; use staged=False "
                          "(the engine then pauses for the whole transfer)")
