"""Inference side of delta sync: apply what changed into the live tensors, all or nothing.

A :class:`DeltaReceiver` is the one receiver session (:class:`~fastsync.sync.receiver.WeightReceiver`:
same plan, landing, NIXL agent, version rule, keys, liveness, deadlines and rollback) over a landing
with one inbox per sender. Per version the caller chooses ``begin(v)`` (a delta against the version
held: :class:`DeltaPayload`) or ``begin(v, dense=True)`` (the ordinary planned writes, e.g. to
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

import time
from typing import Any

import numpy as np
import torch

from fastsync.errors import ConfigError, SyncError
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
from fastsync.protocol import delta_choice_key, delta_mode_key
from fastsync.sync.payload import DensePayload, Payload
from fastsync.sync.receiver import WeightReceiver
from fastsync.transport.nixl.delta import DeltaInbox
from fastsync.transport.nixl.delta_relay import DeltaRelay, stream_bytes

__all__ = ["DeltaReceiver", "DeltaPayload", "DeltaLanding", "InboxLanding", "inbox_sizes", "relay_inbox_sizes"]


class InboxLanding:
    """Mixin for a :class:`Landing`: one delta inbox per sending trainer rank, registered with the
    rest of the landing memory (so the agent metadata published at set-up covers it). Call
    :meth:`add_inboxes` in the constructor, after ``Landing.__init__``."""

    inboxes: dict[int, torch.Tensor]
    relay_inboxes: dict[int, torch.Tensor] = {}

    def add_inboxes(self, inbox_bytes: dict[int, int]) -> None:
        device = self.arena.device  # type: ignore[attr-defined]
        self.inboxes = {s: alloc_touched(n, device) for s, n in inbox_bytes.items()}

    def add_relay_inboxes(self, inbox_bytes: dict[int, int]) -> None:
        """One inbox per origin trainer rank whose stream reaches this rank by relay
        (:func:`relay_inbox_sizes`; plans with relays only)."""
        device = self.arena.device  # type: ignore[attr-defined]
        self.relay_inboxes = {s: alloc_touched(n, device) for s, n in inbox_bytes.items()}

    def buffers(self) -> list[torch.Tensor]:
        boxes = [*self.inboxes.values(), *self.relay_inboxes.values()]
        return super().buffers() + [b for b in boxes if b.numel()]  # type: ignore[misc]

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


def relay_inbox_sizes(plan: Any, rank: int, chunk_elems: int = DELTA_CHUNK_ELEMS) -> dict[int, int]:
    """Bytes of engine rank ``rank``'s relay inbox for each trainer rank whose stream reaches it by
    relay: the size of the chain root's inbox from that trainer rank (empty off a relay chain)."""
    f = plan.fanout
    if f is None or not plan.has_relays:
        return {}
    e = f.replica_size
    k, j = divmod(rank, e)
    if f.parents[k] < 0:
        return {}
    root = k
    while f.parents[root] >= 0:
        root = f.parents[root]
    always = set(f.direct)
    origins = sorted({t.src_rank for i, t in enumerate(plan.transfers) if t.dst_rank == j and i not in always})
    return {s: link_capacity(plan, s, j + root * e, chunk_elems) for s in origins}


class _AnnouncedDense(DensePayload):
    """The planned writes on a receiver with inboxes: says ``dense`` under the mode key, so the
    trainer ranks do not wait for a delta the engine will not take."""

    def announce(self, version: int) -> None:
        self.rx.control.set(delta_mode_key(self.rx.rank, version), b"dense", timeout_s=self.rx.timeout_s)


class DeltaPayload:
    """A version's payload as delta streams (see the module docstring): one stream per sender in
    its inbox, every record checked before any write, applied in place with an undo log, verified
    on the live tensors, then the engine's post-processing (``landing.on_apply``)."""

    kind = "delta"

    def __init__(self, rx: "DeltaReceiver") -> None:
        self.rx = rx
        self.undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.undo_fast: list[tuple] = []

    @property
    def inbox(self) -> DeltaInbox:
        assert self.rx.inbox is not None
        return self.rx.inbox

    def begin(self, version: int, m: SyncMetrics) -> None:
        self.rx.transport.renew_if_pending()  # the last version did not complete: a fresh endpoint
        self.inbox.begin(version)

    def announce(self, version: int) -> None:
        rx = self.rx
        rx.control.set(delta_mode_key(rx.rank, version), f"delta:{rx.version}".encode(), timeout_s=rx.timeout_s)

    def poll(self) -> bool:
        return self.inbox.poll()

    def missing(self) -> dict[Any, str]:
        return self.inbox.missing()

    def senders(self) -> list[int]:
        return list(self.rx.landing.inboxes)

    def commit(self, version: int, m: SyncMetrics) -> None:
        rx = self.rx
        with m.stage("decode"):
            writes, fast = rx._decode(version)
        with m.stage("apply"):
            for flat, pos, vals in writes:
                self.undo.append((flat, pos, _gather(flat, pos)))
                _scatter(flat, pos, vals)
            for flat, off, ids, counts, local, vals, chunk in fast:
                old = np.empty_like(vals)
                delta_apply.swap(flat, off, ids, counts, local, vals, chunk, old)
                self.undo_fast.append((flat, off, ids, counts, local, old, chunk))
        if rx.verify:
            with m.stage("verify"):
                assert rx.program is not None
                rx.verify_against_senders(version, rx.transport.checksum_ranks(rx.program),
                                          {n: as_bytes(t) for n, t in rx.landing.live.items()}, " after the delta",
                                          mode="full")
        on_apply = getattr(rx.landing, "on_apply", None)
        if on_apply is not None:  # the engine's post-processing (e.g. vLLM CPU repacks), before the flip
            with m.stage("postprocess"):
                on_apply()

    def link_bytes(self) -> dict[str, int]:
        """Stream bytes per link: trainer -> this rank, and this rank -> each child it relayed to."""
        me = self.rx.rank
        out = {f"t{s}->r{me}": stream_bytes(b) for s, b in self.rx.landing.inboxes.items()}
        if self.inbox.relay is not None:
            out.update({f"r{me}->r{c}": n for c, n in self.inbox.relay.forwarded.items()})
        return out

    def settle(self) -> None:
        self.undo, self.undo_fast = [], []
        self.rx.landing.mark_changed()
        if self.inbox.relay is not None:
            self.inbox.relay.quiesce(time.monotonic() + 5.0)

    def rollback(self) -> str:
        _undo(self.undo, self.undo_fast)
        self.undo, self.undo_fast = [], []
        if self.inbox.relay is not None:  # no forward may still read this rank's inboxes
            self.inbox.relay.quiesce(time.monotonic() + 5.0)
        if self.inbox.missing():  # pages may still be in flight: a fresh endpoint next version
            self.rx.transport.mark_incomplete()
        return ""


class DeltaReceiver(WeightReceiver):
    """Delta sync on one engine rank. Takes ``WeightReceiver``'s arguments (``transport`` must be
    ``nixl``) plus ``chunk_elems`` (must match the senders'). ``landing``: built here from
    ``mode``/``backup``, or given (an :class:`InboxLanding` with inboxes of :func:`inbox_sizes`,
    e.g. the vLLM extension's). A landing with an ``on_apply`` callable (the engine's
    post-processing) has it run after a delta is written and verified, before the flip is
    published; if it raises, the delta is rolled back like any other failure."""

    landing: InboxLanding  # type: ignore[assignment]

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
        relayed = relay_inbox_sizes(plan, rank, chunk_elems)
        if relayed and not landing.relay_inboxes:
            landing.add_relay_inboxes(relayed)
        elif {s: b.numel() for s, b in landing.relay_inboxes.items()} != relayed:
            raise ConfigError(f"engine rank {rank}: the landing's delta relay inboxes do not match the plan")
        super().__init__(landing=landing, **receiver_kw)
        self.inbox: DeltaInbox | None = None
        self._blocks: dict[int, torch.Tensor | None] = {}

    @property
    def inbox_bytes(self) -> int:
        return sum(b.numel() for b in self.landing.inboxes.values())

    def setup(self) -> None:
        super().setup()
        tr = self.transport
        assert self.program is not None
        relay = None
        if self.program.relay is not None:  # this rank forwards delta streams, or gets them, along a chain
            prog = self.program.relay
            sources = self.landing.relay_inboxes if prog.upstream is not None else self.landing.inboxes
            relay = DeltaRelay(tr, self.rank, prog, sources, self.landing.relay_inboxes, self.control,
                               self.timeout_s, key=tr.notify_key, refuse=tr.refuse)
        self.inbox = DeltaInbox(tr.agent, self.rank, self.landing.inboxes, self.control,
                                getattr(tr, "poll_sleep_s", 0.001), key=tr.notify_key, transport=tr, relay=relay)
        self._blocks = {}
        assert self.program is not None
        delta_apply.warmup({info.itemsize for info in self.program.tensors.values()})

    def begin(self, version: int, *, dense: bool | None = None, payload: Payload | None = None) -> None:
        """A delta against the version held (``dense`` None or False), or (``dense=True``) the
        ordinary planned writes; ``payload`` as for :meth:`WeightReceiver.begin`."""
        if self.inbox is None:
            raise SyncError(f"engine rank {self.rank}: begin() before setup()")
        if payload is None:  # the base checks (and a refusal the trainers read) come before the mode is published
            payload = _AnnouncedDense(self) if dense else DeltaPayload(self)
        super().begin(version, payload=payload)

    def begin_as_chosen(self, version: int) -> None:
        """Dense or delta, as ``WeightSync(delta=True)`` on trainer rank 0 chose for ``version``."""
        self.begin(version, dense=self.control.try_get(delta_choice_key(version)) != b"delta")

    def close(self) -> None:
        if self._open is not None:
            self.abort("receiver closed")
        if self.inbox is not None and self.inbox.relay is not None:
            self.inbox.relay.close()
        super().close()

    # ---- helpers --------------------------------------------------------------------------
    def _streams(self) -> list[tuple[int, torch.Tensor, str, dict[int, Any], set[int]]]:
        """``(origin, buffer, who, items by index, indices to skip)`` of every stream this rank
        applies: the trainer ranks' own, then those relayed to it (their records carry the root
        copy's indices; those of transfers planned direct to every replica are skipped)."""
        program = self.program
        assert program is not None
        out = [(s, inbox, f"engine rank {self.rank}, stream from trainer rank {s}",
                {it.index: it for it in program.by_src.get(s, [])}, set())
               for s, inbox in self.landing.inboxes.items()]
        relay = program.relay
        if relay is not None and relay.upstream is not None:
            f = self.plan.fanout
            root = relay.root_rank // f.replica_size
            skip = {root * relay.num_transfers + i for i in f.direct}
            for s, inbox in self.landing.relay_inboxes.items():
                out.append((s, inbox, f"engine rank {self.rank}, stream from trainer rank {s} relayed by engine rank "
                            f"{relay.upstream}", {it.index: it for it in relay.incoming.get(s, [])}, skip))
        return out

    def _decode(self, version: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], list[tuple]]:
        """Parse and check every stream; returns ``(flat live tensor, positions, values)`` per
        tensor, and the sparse records the one-pass kernels apply (``delta_apply``)."""
        program = self.program
        assert program is not None
        held = self.version
        by_tensor: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        fast: list[tuple] = []
        changed = elements = nbytes = 0
        for s, inbox, who, items, skip in self._streams():
            v, base, recs = read_stream(inbox, who)
            nbytes += int(inbox[:64].view(torch.int64)[4])
            if v != version:
                raise SyncError(f"{who}: stream is for version {v}, expected {version}")
            if base not in (held, -1):
                raise SyncError(f"{who}: delta against version {base}, this rank holds {held}: refusing (a dense "
                                "sync is needed)")
            covered = 0
            for index, first, n, kind, count, payload, extra in recs:
                it = items.get(index)
                if it is None and index in skip:
                    continue  # a relayed stream's record of a transfer this rank gets directly
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
            total = sum(it.transfer.nbytes // self.program.tensors[it.transfer.dst_tensor].itemsize
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
        info = self.program.tensors[t.dst_tensor]
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
