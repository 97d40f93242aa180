"""Inference side of delta sync: apply what changed into the live tensors, all or nothing.

A :class:`DeltaReceiver` wraps a :class:`~fastsync.sync.receiver.WeightReceiver` (same plan,
landing, NIXL agent, version rule and keys). Per version the caller chooses ``begin(v)`` (a delta
against the version held) or ``begin(v, dense=True)`` (the ordinary planned writes, e.g. to
measure both). A delta version:

1. ``begin``: spends ``v`` (the same :class:`~fastsync.sync.handshake.Versions` as dense syncs),
   publishes ``delta:{held version}`` then ``begun``; the engine must not read weights from here
   to the flip (the same fence as an in-place dense sync).
2. ``poll``/``wait``: each trainer rank writes its stream into this rank's inbox (one per sender,
   worst-case sized, registered with the landing memory; ``inbox_bytes``).
3. ``finish``: every stream is parsed and checked first (version, base version == the version held
   or -1 with every chunk dense, transfer indices, element bounds), nothing written until all
   pass; then the changed elements are written into the live tensors, keeping their old values
   (the rollback copy covers exactly what the delta overwrote); with ``verify`` a CRC of every
   planned destination box (the whole destination, not just the changed elements) is checked
   against the sender's CRC of its full new bytes. Any failure restores the old values and the
   receiver keeps serving its last version.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import torch

from fastsync import plugins
from fastsync.control import StoreUnreachable
from fastsync.errors import ConfigError, FastSyncError, SyncError
from fastsync.executor import delta_apply
from fastsync.plan.replicate import receiver_copies
from fastsync.executor.delta import (
    DELTA_CHUNK_ELEMS,
    MAX_SPARSE_CHUNK,
    decode_positions,
    int_view,
    link_capacity,
    read_stream,
    transfer_blocks,
)
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.staging import Landing, alloc_touched, as_bytes
from fastsync.executor.verify import compare_checksums, receiver_checksums
from fastsync.sync.delta_sender import delta_mode_key
from fastsync.sync.handshake import begun_key, begun_value, flipped_key, sender_crc_key, sender_done_key
from fastsync.sync.receiver import _FAILURE_CHECK_S, WeightReceiver
from fastsync.transport.nixl_delta import DeltaInbox

__all__ = ["DeltaReceiver", "DeltaLanding", "InboxLanding", "inbox_sizes"]


class InboxLanding:
    """Mixin for a :class:`Landing`: one delta inbox per sending trainer rank, registered with the
    rest of the landing memory (so the agent metadata published at set-up covers it). Call
    :meth:`add_inboxes` in the constructor, after ``Landing.__init__``."""

    inboxes: dict[int, torch.Tensor]

    def add_inboxes(self, inbox_bytes: dict[int, int]) -> None:
        device = self.arena.device  # type: ignore[attr-defined]
        self.inboxes = {s: alloc_touched(n, device) for s, n in inbox_bytes.items()}

    def buffers(self) -> list[torch.Tensor]:
        return super().buffers() + [b for b in self.inboxes.values() if b.numel()]  # type: ignore[misc]

    def mark_changed(self) -> None:
        """The live tensors moved on outside ``apply``: an in-place backup is stale."""
        self._backup_fresh = False


class DeltaLanding(InboxLanding, Landing):
    """A :class:`Landing` with the delta inboxes (see :class:`InboxLanding`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], inbox_bytes: dict[int, int], **kw: Any) -> None:
        Landing.__init__(self, tensors, **kw)
        self.add_inboxes(inbox_bytes)


def inbox_sizes(plan: Any, rank: int, chunk_elems: int = DELTA_CHUNK_ELEMS) -> dict[int, int]:
    """Bytes of engine rank ``rank``'s inbox for each trainer rank that writes to it (worst case)."""
    srcs = sorted({t.src_rank for _, t in receiver_copies(plan, rank)})  # fan-out: this replica's copies
    return {s: link_capacity(plan, s, rank, chunk_elems) for s in srcs}


class DeltaReceiver:
    """Delta sync on one engine rank. Takes ``WeightReceiver``'s arguments (``transport`` must be
    ``nixl``) plus ``chunk_elems`` (must match the senders'). ``landing``: built here from
    ``mode``/``backup``, or given (an :class:`InboxLanding` with inboxes of :func:`inbox_sizes`,
    e.g. the vLLM extension's). A landing with an ``on_apply`` callable (the engine's
    post-processing) has it run after a delta is written and verified, before the flip is
    published; if it raises, the delta is rolled back like any other failure."""

    def __init__(self, *, chunk_elems: int = DELTA_CHUNK_ELEMS, mode: str = "shadow", backup: bool = False,
                 landing: InboxLanding | None = None, **receiver_kw: Any) -> None:
        if receiver_kw.get("transport", "nixl") != "nixl":
            raise ConfigError(f"delta sync writes over NIXL; transport={receiver_kw['transport']!r} is not supported")
        if landing is not None and not isinstance(landing, InboxLanding):
            raise ConfigError(f"DeltaReceiver's landing must carry the delta inboxes (InboxLanding), got "
                              f"{type(landing).__name__}")
        tensors = receiver_kw["tensors"]
        if isinstance(tensors, torch.nn.Module):
            tensors = {n: p.data for n, p in tensors.named_parameters()}
            receiver_kw["tensors"] = tensors
        bad = [n for n, t in tensors.items() if not t.is_contiguous()]
        if bad:
            raise ConfigError(f"delta sync writes live tensors in place; {bad[:3]} are not contiguous")
        plan, rank = receiver_kw["plan"], receiver_kw["rank"]
        sizes = inbox_sizes(plan, rank, chunk_elems)
        if landing is None:
            landing = DeltaLanding(tensors, sizes, mode=mode, backup=backup)
        elif {s: b.numel() for s, b in landing.inboxes.items()} != sizes:
            raise ConfigError(f"engine rank {rank}: the landing's delta inboxes do not match the plan "
                              f"({ {s: b.numel() for s, b in landing.inboxes.items()} } vs {sizes})")
        self.inner = WeightReceiver(landing=landing, **receiver_kw)
        self.landing = landing
        self.rank = rank
        self.inbox: DeltaInbox | None = None
        self._open: int | None = None
        self._complete = False
        self._metrics: SyncMetrics | None = None
        self.last_metrics: SyncMetrics | None = None
        self.last_stats: dict[str, Any] = {}
        self._dense_open = False
        self._last_check = 0.0

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def versions(self) -> Any:
        return self.inner.versions

    @property
    def transport(self) -> Any:
        return self.inner.transport

    @property
    def inbox_bytes(self) -> int:
        return sum(b.numel() for b in self.landing.inboxes.values())

    def setup(self) -> None:
        self.inner.setup()
        tr = self.inner.transport
        self.inbox = DeltaInbox(tr.agent, self.rank, self.landing.inboxes, self.inner.control,
                                getattr(tr, "poll_sleep_s", 0.001), key=tr._key, transport=tr)
        self._blocks: dict[int, torch.Tensor | None] = {}
        delta_apply.warmup({info.itemsize for info in self.inner.program.tensors.values()})

    # ---- one sync -------------------------------------------------------------------------
    def begin(self, version: int, *, dense: bool = False) -> None:
        inner = self.inner
        if self.inbox is None:
            raise SyncError(f"engine rank {self.rank}: begin() before setup()")
        if self._open is not None or self._dense_open:
            raise SyncError(f"engine rank {self.rank}: version {version} begun while another is open")
        if dense:
            inner.control.set(delta_mode_key(self.rank, version), b"dense")
            inner.begin(version)
            self._dense_open = True
            return
        if version <= inner.version:
            raise SyncError(f"engine rank {self.rank}: version {version} is not newer than held {inner.version}")
        inner.versions.spend(version)
        self._metrics = SyncMetrics(version, "engine", self.rank, "nixl-delta", start=time.time())
        plugins.hook().fastsync_before_sync(version=version, role="engine", rank=self.rank, plan=inner.plan)
        inner.transport.renew_if_pending()  # the last version did not complete: a fresh endpoint
        self.inbox.begin(version)
        self._open, self._complete = version, False
        try:
            inner.control.set(delta_mode_key(self.rank, version), f"delta:{inner.version}".encode(),
                              timeout_s=inner.timeout_s)
            inner.control.set(begun_key(self.rank, version), begun_value(inner.verify, inner.transport.endpoint()),
                              timeout_s=inner.timeout_s)
        except StoreUnreachable as e:
            self.abort(f"cannot announce the version: {e}")
            raise SyncError(f"engine rank {self.rank}: version {version} not begun, keeping version "
                            f"{self.version}: {e}") from e

    def poll(self) -> bool:
        if self._dense_open:
            return self.inner.poll()
        if self._open is None:
            raise SyncError(f"engine rank {self.rank}: poll() with no version open")
        if not self._complete:
            assert self.inbox is not None
            self._complete = self.inbox.poll()
            now = time.monotonic()
            if not self._complete and now - self._last_check > _FAILURE_CHECK_S:
                self._last_check = now  # a control-plane round trip per sender: not on every poll
                for s in self.landing.inboxes:
                    try:
                        got = self.inner.control.try_get(sender_done_key(s, self._open), timeout_s=1.0)
                    except StoreUnreachable:  # cut off from the store: keep polling until the deadline
                        break
                    if got is not None and got.startswith(b"err:") and s in self.inbox.missing():
                        version = self._open
                        msg = f"trainer rank {s} failed ({got[4:].decode(errors='replace')})"
                        self.abort(msg)
                        raise SyncError(f"engine rank {self.rank}: version {version} failed, keeping version "
                                        f"{self.version}: {msg}")
                self._check_liveness()
        return self._complete

    def _check_liveness(self) -> None:
        """Fail the open version at once when a trainer rank whose stream has not fully arrived
        died (one that finished its stream may exit: it is not waited for)."""
        watch = self.inner.watch
        if watch is None or self.inbox is None:
            return
        missing = self.inbox.missing()
        gone = [r for role, r in watch.dead() if role == "trainer" and r in missing]
        if gone:
            version = self._open
            names = ", ".join(f"trainer rank {r}" for r in gone)
            msg = (f"{names} died during version {version}: its process ended (its heartbeat connection to the "
                   "control store closed)")
            self.abort(msg)
            raise SyncError(f"engine rank {self.rank}: version {version} failed, keeping version {self.version}: {msg}")

    def wait(self, deadline: float | None = None) -> bool:
        if self._dense_open:
            return self.inner.wait(deadline)
        if deadline is None:
            deadline = time.monotonic() + self.inner.timeout_s
        assert self._metrics is not None
        with self._metrics.stage("wait"):
            while not self.poll():
                if time.monotonic() >= deadline:
                    return False
        return True

    def finish(self) -> int:
        if self._dense_open:
            self._dense_open = False
            v = self.inner.finish()
            self.last_metrics = self.inner.last_metrics
            self.last_stats = {"mode": "dense"}
            return v
        if self._open is None:
            raise SyncError(f"engine rank {self.rank}: finish() with no version open")
        version, m = self._open, self._metrics
        assert m is not None and self.inbox is not None
        undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        undo_fast: list[tuple] = []
        try:
            if not self._complete:
                missing = "; ".join(f"trainer rank {s}: {w}" for s, w in sorted(self.inbox.missing().items()))
                raise SyncError(f"engine rank {self.rank}: version {version} incomplete, keeping version "
                                f"{self.version}; {missing or 'delta streams incomplete'}")
            with m.stage("decode"):
                writes, fast = self._decode(version)
            with m.stage("apply"):
                for flat, pos, vals in writes:
                    undo.append((flat, pos, _gather(flat, pos)))
                    _scatter(flat, pos, vals)
                for flat, off, ids, counts, local, vals, chunk in fast:
                    old = np.empty_like(vals)
                    delta_apply.swap(flat, off, ids, counts, local, vals, chunk, old)
                    undo_fast.append((flat, off, ids, counts, local, old, chunk))
            if self.inner.verify:
                with m.stage("verify"):
                    self._verify(version)
            on_apply = getattr(self.landing, "on_apply", None)
            if on_apply is not None:  # the engine's post-processing (e.g. vLLM CPU repacks), before the flip
                with m.stage("postprocess"):
                    on_apply()
        except FastSyncError as e:
            _undo(undo, undo_fast)
            self.abort(str(e))
            raise
        except Exception as e:
            _undo(undo, undo_fast)
            self.abort(f"{type(e).__name__}: {e}")
            raise SyncError(f"engine rank {self.rank}, version {version}: {type(e).__name__}: {e}") from e
        self.landing.mark_changed()
        self.inner.version = version
        self._open = None
        m.ok = True
        m.end = time.time()
        self.last_metrics = m
        try:
            self.inner.control.set(flipped_key(self.rank, version), b"ok", timeout_s=2.0)
        except StoreUnreachable as e:  # serving a complete version; the trainers' wait ends at their deadline
            m.error = f"flipped, but could not tell the control store: {e}"
        plugins.hook().fastsync_after_sync(version=version, role="engine", rank=self.rank, metrics=m.to_json(), ok=True)
        return version

    def abort(self, reason: str) -> None:
        if self._dense_open:
            self._dense_open = False
            self.inner.abort(reason)
            return
        if self._open is None:
            return
        version, m = self._open, self._metrics
        self._open = None
        assert m is not None
        m.error = reason
        m.end = time.time()
        self.last_metrics = m
        if self.inbox is not None and self.inbox.missing():  # pages may still be in flight: fresh endpoint next
            self.inner.transport.mark_incomplete()
        try:
            self.inner.control.set(flipped_key(self.rank, version), f"err:{reason}", timeout_s=2.0)
        except StoreUnreachable:  # rolled back already; the trainers' deadline covers them
            pass
        plugins.hook().fastsync_after_sync(version=version, role="engine", rank=self.rank, metrics=m.to_json(), ok=False)

    def sync(self, version: int, *, dense: bool = False, timeout_s: float | None = None) -> int:
        self.begin(version, dense=dense)
        self.wait(time.monotonic() + (self.inner.timeout_s if timeout_s is None else timeout_s))
        return self.finish()

    def close(self) -> None:
        if self._open is not None or self._dense_open:
            self.abort("receiver closed")
        self.inner.close()

    # ---- helpers --------------------------------------------------------------------------
    def _decode(self, version: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], list[tuple]]:
        """Parse and check every stream; returns ``(flat live tensor, positions, values)`` per
        tensor, and the sparse records the one-pass kernels apply (``delta_apply``)."""
        program = self.inner.program
        assert program is not None
        held = self.inner.version
        by_tensor: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        fast: list[tuple] = []
        changed = elements = nbytes = 0
        for s, inbox in self.landing.inboxes.items():
            who = f"engine rank {self.rank}, stream from trainer rank {s}"
            v, base, recs = read_stream(inbox, who)
            nbytes += int(inbox[:64].view(torch.int64)[4])
            if v != version:
                raise SyncError(f"{who}: stream is for version {v}, expected {version}")
            if base not in (held, -1):
                raise SyncError(f"{who}: delta against version {base}, this rank holds {held}: refusing (a dense "
                                "sync is needed)")
            items = {it.index: it for it in program.by_src.get(s, [])}
            covered = 0
            for index, first, n, kind, count, payload, extra in recs:
                it = items.get(index)
                if it is None:
                    raise SyncError(f"{who}: record for transfer {index}, which trainer rank {s} does not send here")
                t = it.transfer
                info = program.tensors[t.dst_tensor]
                size = info.itemsize
                numel = t.nbytes // size
                if first < 0 or first + n > numel:
                    raise SyncError(f"{who}: record covers elements [{first}, {first + n}) of transfer {index} "
                                    f"({t.dst_tensor!r}), which has {numel}")
                if base == -1 and kind != "dense":
                    raise SyncError(f"{who}: a stream with no base must be dense, record for transfer {index} is {kind}")
                op = self._fast_op(who, it, first, n, count, payload, extra) if kind == "sparse" else None
                if op is not None:
                    fast.append(op)
                    changed += op[4].shape[0]
                    continue
                blocks = None
                if kind == "blocks":
                    if index not in self._blocks:
                        self._blocks[index] = transfer_blocks(t)
                    blocks = self._blocks[index]
                idx, vals = decode_positions(kind, n, count, payload, size, blocks, who, extra)
                covered += n if kind == "dense" else 0
                local = torch.arange(first, first + n) if idx is None else idx + first
                pos = _dst_elements(it.dst_runs, size, local)
                group = by_tensor.setdefault(t.dst_tensor, ([], []))
                group[0].append(pos)
                group[1].append(vals)
                changed += local.numel()
            total = sum(it.transfer.nbytes // self.inner.program.tensors[it.transfer.dst_tensor].itemsize
                        for it in items.values())
            elements += total
            if base == -1 and covered != total:
                raise SyncError(f"{who}: dense stream covers {covered} of {total} elements")
        self.last_stats = {"mode": "delta", "changed": changed, "elements": elements, "bytes": nbytes}
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for name, (poss, valss) in by_tensor.items():
            size = program.tensors[name].itemsize
            flat = int_view(as_bytes(self.landing.live[name]), size)
            pos = poss[0] if len(poss) == 1 else torch.cat(poss)
            vals = int_view(valss[0].clone() if len(valss) == 1 else torch.cat(valss), size)
            out.append((flat, pos, vals))
        return out, fast

    def _fast_op(self, who: str, it: Any, first: int, n: int, count: int, payload: torch.Tensor,
                 extra: tuple[int, int]) -> tuple | None:
        """A checked ``sparse`` record for the one-pass kernels, or None when they do not cover
        it (no numba, a GPU tensor, a transfer landing in several runs, odd element sizes)."""
        t = it.transfer
        info = self.inner.program.tensors[t.dst_tensor]
        size = info.itemsize
        live = self.landing.live[t.dst_tensor]
        if not delta_apply.available() or live.device.type != "cpu" or len(it.dst_runs) != 1 or size not in (2, 4):
            return None
        chunk, k = extra
        if not 0 < chunk <= MAX_SPARSE_CHUNK or k < 0:
            raise SyncError(f"{who}: sparse record with chunk size {chunk} and {k} elements")
        a, b = -(-4 * count // 8) * 8, -(-2 * k // 8) * 8
        if payload.numel() < 2 * a + b + k * size:
            raise SyncError(f"{who}: sparse record shorter than its {count} chunks and {k} elements")
        body = payload.numpy()
        uint = np.uint16 if size == 2 else np.uint32
        ids = body[: 4 * count].view(np.int32)
        counts = body[a: a + 4 * count].view(np.int32)
        local = body[2 * a: 2 * a + 2 * k].view(np.uint16)
        vals = body[2 * a + b: 2 * a + b + k * size].view(uint)
        if not delta_apply.check(ids, counts, local, chunk, n):
            raise SyncError(f"{who}: sparse record of transfer {t.dst_tensor!r}: chunk table or positions out of "
                            f"order or outside its {n} elements")
        flat = as_bytes(live).numpy().view(uint)
        return flat, it.dst_runs[0][0] // size + first, ids, counts, local, vals, chunk

    def _verify(self, version: int) -> None:
        program = self.inner.program
        assert program is not None
        expected: dict[int, int] = {}
        deadline = time.monotonic() + self.inner.timeout_s
        for s in program.by_src:
            raw = self.inner.control.get(sender_crc_key(s, version), max(0.0, deadline - time.monotonic()),
                                         what=f"trainer rank {s} (checksums of version {version})")
            expected.update({int(k): v for k, v in json.loads(raw).items()})
        regions = {n: as_bytes(t) for n, t in self.landing.live.items()}
        bad = compare_checksums(program, expected, receiver_checksums(program, regions))
        if bad:
            raise SyncError(f"engine rank {self.rank}: version {version} failed verification after the delta: "
                            + "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))


def _dst_elements(dst_runs: list[tuple[int, int]], itemsize: int, local: torch.Tensor) -> torch.Tensor:
    """Element offsets in the destination tensor of a transfer's elements ``local`` (positions in
    the transfer's row-major order), through its destination byte runs."""
    if len(dst_runs) == 1:
        return local + dst_runs[0][0] // itemsize
    lens = torch.tensor([n // itemsize for _, n in dst_runs], dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    offs = torch.tensor([o // itemsize for o, _ in dst_runs], dtype=torch.int64)
    r = torch.searchsorted(starts, local, right=True) - 1
    return offs[r] + (local - starts[r])


def _undo(undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], undo_fast: list[tuple]) -> None:
    """Put back what the delta overwrote, newest first."""
    for flat, off, ids, counts, local, old, chunk in reversed(undo_fast):
        delta_apply.restore(flat, off, ids, counts, local, old, chunk)
    for flat, pos, old in reversed(undo):
        _scatter(flat, pos, old)


def _gather(flat: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``flat[pos]`` (numpy's take on the CPU: several times faster than torch's indexing here)."""
    if flat.device.type == "cpu":
        return torch.from_numpy(flat.numpy()[pos.numpy()])
    return flat[pos]


def _scatter(flat: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor) -> None:
    """``flat[pos] = vals`` in place."""
    if flat.device.type == "cpu":
        flat.numpy()[pos.numpy()] = vals.numpy()
    else:
        flat[pos] = vals
