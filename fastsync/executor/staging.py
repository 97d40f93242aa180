"""Memory that syncs write through: the sender's staging arena and the receiver's landing regions.

Both are allocated and touched once at setup: copying into never-touched pages ran 20x slower on
the reference machine (page faults), and NIXL registers each buffer once.

Receiver atomicity (``Landing``):

* ``mode="shadow"`` (default): every write lands in one shadow arena, never in the live tensors.
  The live tensors change only in :meth:`Landing.apply`, called at the version flip, after every
  expected write arrived (and verified). A failed or interrupted sync leaves the live tensors
  untouched. Cost: one extra copy of the receiver's bytes per sync (at flip) and the same amount
  of extra memory.
* ``mode="inplace"``: writes land straight in the live tensors' memory (zero extra copies on the
  sync's critical path, what an engine that is paused during the update wants). The engine must
  not read while a sync is in flight (fence generation). With ``backup=True`` a copy of the last
  complete version is kept and restored if a sync fails, so that version is served again. The
  backup is refreshed by :meth:`Landing.refresh_backup` (``WeightReceiver.prepare()``), which the
  engine calls between syncs, while the trainers train; ``begin`` refreshes it itself when the
  caller did not, so correctness never depends on that call, only where its cost lands (one copy
  of the receiver's bytes per sync, plus the memory). Without backup a failed sync leaves the
  tensors torn and the receiver says so (``Landing.torn``).
* A live tensor that cannot take writes in place (not contiguous) always gets a staging region in
  the arena and is copied at flip, in either mode.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fastsync.errors import ConfigError
from fastsync.executor.program import ALIGN_BYTES, TensorInfo
from fastsync.executor.transforms import to_torch_dtype

__all__ = ["alloc_touched", "wait_device", "as_bytes", "tensor_digest", "dtype_name", "torch_dtype", "Landing", "LANDING_MODES"]

LANDING_MODES = ("shadow", "inplace")


def alloc_touched(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` on ``device`` with every page already faulted in (on a GPU:
    allocated once, so NIXL registers VRAM once)."""
    buf = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
    buf.zero_()
    return buf


def wait_device(t: torch.Tensor) -> None:
    """Wait for the work torch queued on ``t``'s GPU (no-op for CPU tensors)."""
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: layout dtype name -> torch dtype (one definition, in the transforms module)
torch_dtype = to_torch_dtype


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 (16 hex digits) of a CPU tensor's plain bytes: what an engine rank's
    ``fastsync_digest`` reports per tensor, and what tests and smokes compare it with."""
    import hashlib

    return hashlib.sha256(as_bytes(t.contiguous()).numpy().tobytes()).hexdigest()[:16]


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class Landing:
    """Where a receiver's incoming bytes land, and how they reach the live tensors.

    ``regions[name]`` is a flat uint8 tensor the transports write into (registered with NIXL,
    received into by gloo). The live tensors are never copied or replaced: ``apply`` copies into
    their existing memory, so an engine holding references to them sees the new values.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], mode: str = "shadow", backup: bool = False,
                 shadow: Iterable[str] = ()) -> None:
        """``shadow``: in ``inplace`` mode, tensors that still land in the arena and reach their
        live memory only at :meth:`apply` (an engine's live parameters while it keeps generating)."""
        if mode not in LANDING_MODES:
            raise ConfigError(f"landing mode must be one of {LANDING_MODES}, got {mode!r}")
        if backup and mode != "inplace":
            raise ConfigError("backup=True only applies to mode='inplace' (shadow mode never touches live tensors)")
        self.mode = mode
        self.backup = backup
        self.live = tensors
        self.infos = {n: TensorInfo(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
        shadow = set(shadow)
        self.staged: list[str] = [
            n for n, t in tensors.items() if mode == "shadow" or not t.is_contiguous() or n in shadow
        ]
        arena_names = list(self.staged) + ([n for n in tensors if n not in self.staged] if backup else [])
        offsets: dict[str, int] = {}
        total = 0
        for n in arena_names:
            offsets[n] = total
            total += _align(self.infos[n].nbytes)
        # the arena lives where the live tensors do (VRAM for an engine on a GPU)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self.arena = alloc_touched(total, device) if total else torch.empty(0, dtype=torch.uint8, device=device)
        self.arena_bytes = total
        self.regions: dict[str, torch.Tensor] = {}
        self._backup: dict[str, torch.Tensor] = {}
        for n, t in tensors.items():
            if n in self.staged:
                self.regions[n] = self.arena[offsets[n]: offsets[n] + self.infos[n].nbytes]
            else:
                self.regions[n] = as_bytes(t)
                if backup:
                    self._backup[n] = self.arena[offsets[n]: offsets[n] + self.infos[n].nbytes]
        self.torn = False
        self._backup_fresh = False

    def buffers(self) -> list[torch.Tensor]:
        """Distinct memory the transports must register: the arena plus in-place tensors."""
        out = [self.arena] if self.arena.numel() else []
        out += [self.regions[n] for n in self.live if n not in self.staged and self.regions[n].numel()]
        return out

    @property
    def backup_fresh(self) -> bool:
        return not self._backup or self._backup_fresh

    def refresh_backup(self) -> None:
        """Copy the live in-place tensors into the backup (call between syncs)."""
        for n, b in self._backup.items():
            b.copy_(self.regions[n])
        self._backup_fresh = True

    def begin(self) -> None:
        """Before any write of a new version lands: make sure the backup holds the live version."""
        if self._backup and not self._backup_fresh:
            self.refresh_backup()

    def apply(self, names: list[str] | None = None) -> None:
        """Copy staged regions into the live tensors (the flip)."""
        for n in self.staged if names is None else names:
            live = self.live[n]
            src = self.regions[n]
            if live.is_contiguous():
                as_bytes(live).copy_(src)
            else:
                live.copy_(src.view(live.dtype).view(live.shape))
        wait_device(self.arena)  # on a GPU the flip is done when the copies are, not when queued
        self.torn = False
        self._backup_fresh = False  # the live tensors moved on; the backup holds the old version

    def rollback(self) -> bool:
        """After a failed sync: restore in-place tensors from the backup. Returns True when the
        live tensors hold the last complete version (always true in shadow mode)."""
        if self._backup:
            for n, b in self._backup.items():
                self.regions[n].copy_(b)
            wait_device(self.arena)
            self.torn = False
            return True
        in_place = [n for n in self.live if n not in self.staged]
        self.torn = bool(in_place)
        return not self.torn

    def view(self, name: str) -> torch.Tensor:
        """The landing region of ``name`` as a tensor of its dtype and shape."""
        info = self.infos[name]
        return self.regions[name].view(torch_dtype(info.dtype)).view(info.shape)
