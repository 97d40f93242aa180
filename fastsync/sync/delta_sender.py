"""Trainer side of delta sync: keep the last version sent, send only what changed.

A :class:`DeltaSender` wraps a :class:`~fastsync.sync.sender.WeightSender` (same plan, program,
NIXL agent, version rule and control-plane keys) and adds, per engine rank it writes to:

* the *base*: the bytes of every planned transfer exactly as the engine holds them (after the
  cast or FP8 quantisation, not the fp32 master), from the last version sent, and the number of
  that version. Memory: one copy of this rank's planned bytes (``base_bytes``), on the sources'
  device (host memory for CPU shards);
* an *outbox* of the worst-case stream size (``outbox_bytes``, every chunk dense, about this
  rank's planned bytes plus 64 bytes per delta chunk), registered with NIXL once.

Per version each engine rank says, before anything moves, whether it wants a dense sync (the
ordinary planned writes) or a delta stream, and which version it holds (``delta_mode_key``). A
delta is encoded only against a base of exactly that version; otherwise (a receiver that
restarted, rolled back, missed a version, or is new) every chunk goes dense inside the stream,
stamped base -1. After a dense sync the base is refreshed from the same sources.

Example (on every trainer rank, after ``optimizer.step()``)::

    sender = DeltaSender(rank=rank, plan=plan, sources=shards, shards=layout, control=control)
    sender.setup()
    for step in range(num_steps):
        train_step()
        sender.sync(version=step + 1)     # dense or delta, as the engine ranks asked
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from fastsync.errors import ConfigError, SyncError
from fastsync.protocol import delta_mode_key, sender_crc_key, sender_done_key
from fastsync.executor import delta_scan
from fastsync.executor.delta import (
    DELTA_CHUNK_ELEMS,
    HEADER_BYTES,
    MAX_SPARSE_CHUNK,
    chunk_spans,
    encode_chunk,
    encode_scanned,
    encode_transfer,
    int_view,
    link_capacity,
    transfer_blocks,
    transfer_itemsize,
    write_stream_header,
)
from fastsync.executor.arena import carve
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.pack import source_view, transform_into
from fastsync.executor.staging import alloc_touched, wait_device
from fastsync.executor.transforms import to_torch_dtype
from fastsync.executor.verify import crc_update
from fastsync.plan.replicate import relay_descendants, sender_copies
from fastsync.sync.sender import WeightSender
from fastsync.transport.nixl.delta import DeltaOutbox

__all__ = ["DeltaSender"]


#: How long a trainer rank waits for the ranks down a relay chain to say which version they hold
#: (after the chain's root began); one that has not said by then gets that chain's links dense.
_CHAIN_WAIT_S = 2.0


class DeltaSender:
    """Delta sync on one trainer rank. Takes ``WeightSender``'s arguments (``transport`` must be
    ``nixl``) plus ``chunk_elems`` (elements per delta chunk, the unit of the dense-vs-delta choice),
    ``page_bytes`` (NIXL write size of a stream; default: the outbox / 64, at least 64 KiB) and
    ``threads`` (threads of the fused CPU scan, default ``torch.get_num_threads()``: the same
    threads a dense sync's cast gets)."""

    def __init__(self, *, chunk_elems: int = DELTA_CHUNK_ELEMS, page_bytes: int | None = None,
                 threads: int | None = None, **sender_kw: Any) -> None:
        if not 1 <= chunk_elems <= MAX_SPARSE_CHUNK:
            raise ConfigError(f"chunk_elems must be in [1, {MAX_SPARSE_CHUNK}], got {chunk_elems}")
        if sender_kw.get("transport", "nixl") != "nixl":
            raise ConfigError(f"delta sync writes over NIXL; transport={sender_kw['transport']!r} is not supported")
        self.inner = WeightSender(**sender_kw)
        self.chunk_elems = chunk_elems
        self.page_bytes = page_bytes
        self.threads = max(1, torch.get_num_threads() if threads is None else int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self._pos: np.ndarray | None = None  # positions scratch of the fused CPU scan
        self._no_scan: dict[int, bool] = {}  # transfer -> the fused scan does not cover it
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # transfer -> (base, values scratch) views
        self.rank = self.inner.rank
        self.plan = self.inner.plan
        # every copy this rank writes itself (with fan-out, one per replica it feeds), flat-indexed
        self.mine = sender_copies(self.plan, self.rank)
        # engine rank -> the ranks its streams are relayed to, down its chain (plans with relays)
        self.chains = {d: relay_descendants(self.plan, d) for d in self.inner.dsts}
        self._chain_ok: dict[int, bool] = {}
        self.base_version: dict[int, int] = {}  # engine rank -> version the base holds for it
        self.base: dict[int, torch.Tensor] = {}
        self.outbox: DeltaOutbox | None = None
        self.last_stats: dict[str, Any] = {}
        self.last_metrics: SyncMetrics | None = None

    # ---- set-up ---------------------------------------------------------------------------
    def setup(self) -> None:
        self.inner.setup()
        device = next(iter(self.inner.sources.values())).device if self.inner.sources else torch.device("cpu")
        # 8-aligned: integer views
        self._base_arena, views = carve(None, [(i, t.nbytes) for i, t in self.mine], align=8, device=device)
        self.base.update(views)
        self._scratch = alloc_touched(max((t.nbytes for _, t in self.mine), default=1), device)
        self._no_scan.clear()
        self._views.clear()  # views of the arenas just allocated are made at the first scan
        if device.type == "cpu" and delta_scan.available():  # positions scratch of the fused scan
            most = max((t.nbytes // transfer_itemsize(t) for _, t in self.mine), default=1)
            self._pos = alloc_touched(2 * most, device).numpy().view(np.uint16)
            delta_scan.warmup(self._scan_kinds())
            if self.threads > 1 and self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastsync-delta-scan")
        boxes = {d: alloc_touched(link_capacity(self.plan, self.rank, d, self.chunk_elems), device)
                 for d in self.inner.dsts}
        tr = self.inner.transport
        self.outbox = DeltaOutbox(tr.agent, self.rank, boxes, tr.remote_agents, self.inner.control, self.inner.timeout_s,
                                  self.page_bytes, key=tr.notify_key, agent_name=tr.agent_name,
                                  transport=tr)
        self._blocks = {i: transfer_blocks(t) for i, t in self.mine if t.transform == "fp8_block"}

    @property
    def base_bytes(self) -> int:
        return self._base_arena.numel()

    @property
    def outbox_bytes(self) -> int:
        return sum(b.numel() for b in self.outbox.outboxes.values()) if self.outbox else 0

    # ---- one sync -------------------------------------------------------------------------
    def sync(self, version: int, *, verify: bool | None = None, timeout_s: float | None = None,
             wait_receivers: bool = False, on_page: Callable[[int], None] | None = None) -> SyncMetrics:
        """Send ``version`` dense or as a delta, as the engine ranks asked (mixing both on one
        trainer rank is refused before any byte moves)."""
        if self.outbox is None:
            raise SyncError(f"trainer rank {self.rank}: sync() before setup()")
        inner = self.inner
        timeout = inner.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        asked, endpoints = inner.wait_begun(version, deadline)
        modes: dict[int, str] = {}
        for d in inner.dsts:
            raw = inner.control.try_get(delta_mode_key(d, version), timeout_s=max(0.05, deadline - time.monotonic()))
            modes[d] = "dense" if raw is None else raw.decode()
        below = self._chain_modes(version, deadline)
        dense = [d for d, m in modes.items() if m == "dense"]
        if len(dense) == len(modes):
            return self._dense(version, verify, timeout_s, wait_receivers)
        inner.transport.expect_endpoints(endpoints)  # an engine rank that renewed its endpoint: reconnect first
        inner.versions.spend(version)

        def forget_base() -> None:
            self.base_version = {}

        with inner.version_scope(version, "nixl-delta", on_fail=forget_base,
                                 record=lambda m: setattr(self, "last_metrics", m)) as m:
            if dense:
                raise SyncError(f"trainer rank {self.rank}, version {version}: engine ranks {dense} asked for a "
                                f"dense sync, {sorted(set(modes) - set(dense))} for a delta; one trainer rank sends "
                                "one kind per version")
            held = {d: int(mode.split(":", 1)[1]) for d, mode in modes.items()}
            # a stream relayed down a chain must fit every rank of it: else that chain's links go dense
            self._chain_ok = {d: all(below.get(c) == f"delta:{held[d]}" for c in self.chains.get(d, ())) for d in held}
            # delta versions are digested in full, whatever an engine rank asked for (fastsync.executor.verify)
            crcs: dict[int, int] | None = {} if inner.digests(version, asked, verify, full_only=True) else None
            if inner.gather is not None:
                inner.gather.run(deadline, m)
            with m.stage("encode"):
                sizes = self._encode(version, held, crcs)
            with m.stage("post"):
                self.outbox.post(version, sizes, deadline, on_page)
            left = max(deadline - time.monotonic(), 1.0)  # the pages are posted: telling the engines may take a moment
            if crcs is not None:
                inner.control.set(sender_crc_key(self.rank, version), json.dumps(crcs), timeout_s=left)
            inner.control.set(sender_done_key(self.rank, version), b"ok", timeout_s=left)
            self.base_version = {d: version for d in held}
            m.bytes_per_link = {f"t{self.rank}->r{d}": n for d, n in sizes.items()}
            if wait_receivers:
                inner.wait_flips(version, deadline, m)
        return m

    def _chain_modes(self, version: int, deadline: float) -> dict[int, str]:
        """What every engine rank down this rank's relay chains asked for ``version`` (they begin on
        their own clock: waited for briefly; one that has not said is sent dense links)."""
        want = sorted({c for d in self.inner.dsts for c in self.chains.get(d, ())})
        out: dict[int, str] = {}
        until = min(deadline, time.monotonic() + _CHAIN_WAIT_S)
        while want:
            for c in list(want):
                raw = self.inner.control.try_get(delta_mode_key(c, version), timeout_s=max(0.05, until - time.monotonic()))
                if raw is not None:
                    out[c] = raw.decode()
                    want.remove(c)
            if not want or time.monotonic() >= until:
                break
            time.sleep(0.002)
        return out

    def _dense(self, version: int, verify: bool | None, timeout_s: float | None, wait_receivers: bool) -> SyncMetrics:
        self.base_version = {}
        m = self.inner.sync(version, verify=verify, timeout_s=timeout_s, wait_receivers=wait_receivers)
        # the sources still hold what was just sent: refresh the base from them
        for i, t in self.mine:
            self._pack(t, self.base[i])
        wait_device(self._base_arena)
        self.base_version = {d: version for d in self.inner.dsts}
        self.last_stats = {"mode": "dense", "bytes_dense": self.inner.program.bytes_total,
                           "bytes_sent": self.inner.program.bytes_total}
        self.last_metrics = m
        return m

    def _pack(self, t: Any, out_u8: torch.Tensor) -> None:
        dtype = self.inner.program.dst_info[t.dst_rank][t.dst_tensor].dtype
        gathered = self.inner.gather.full if self.inner.gather is not None else None
        src = source_view(t, self.inner.sources, self.inner.shards, gathered)
        transform_into(out_u8, src, t.transform, dtype)

    def _encode(self, version: int, held: dict[int, int], crcs: dict[int, int] | None) -> dict[int, int]:
        """Encode every transfer into its receiver's outbox; update the base. Returns stream bytes."""
        assert self.outbox is not None
        pos = {d: HEADER_BYTES for d in held}
        records = {d: 0 for d in held}
        # a delta only against the exact version the receiver holds; else every chunk dense
        self._delta_ok = {d: self.base_version.get(d) == h and self._chain_ok.get(d, True) for d, h in held.items()}
        self.base_version = {}  # the base is being overwritten: invalid until this version is sent
        changed = elements = dense_bytes = 0
        for i, t in self.mine:
            d = t.dst_rank
            size = transfer_itemsize(t)
            k = self._scan(i, t, pos, records, crcs) if self._delta_ok[d] else None
            if k is not None:
                changed += k
                elements += t.nbytes // size
                dense_bytes += t.nbytes
                continue
            new_u8 = self._scratch[: t.nbytes]
            self._pack(t, new_u8)
            wait_device(new_u8)
            new, old = int_view(new_u8, size), int_view(self.base[i], size)
            box = self.outbox.outboxes[d]
            if self._delta_ok[d] and t.transform != "fp8_block":
                pos[d], k, r = encode_transfer(box, pos[d], i, new, old, self.chunk_elems)
                records[d] += r
                changed += k
            else:
                for first, n in chunk_spans(t, size, self.chunk_elems):
                    p, k = encode_chunk(box, pos[d], i, first, new[first: first + n], old[first: first + n],
                                        force_dense=not self._delta_ok[d], blocks=self._blocks.get(i))
                    records[d] += p != pos[d]
                    pos[d] = p
                    changed += k
                self.base[i].copy_(new_u8)
            elements += new.numel()
            dense_bytes += t.nbytes
            if crcs is not None:
                crcs[i] = crc_update(0, new_u8)
        for d in held:
            write_stream_header(self.outbox.outboxes[d], version, held[d] if self._delta_ok[d] else -1,
                                records[d], pos[d])
        self.last_stats = {"mode": "delta", "changed": changed, "elements": elements, "bytes_dense": dense_bytes,
                           "bytes_sent": sum(pos.values()), "dense_links": sorted(d for d, ok in self._delta_ok.items() if not ok)}
        return pos

    def _scan_kinds(self) -> set:
        """The fused-scan kernel signatures this rank's transfers need (gathered ones compile at
        first use: their full tensors do not exist before a sync)."""
        kinds = set()
        for _, t in self.mine:
            if t.gathered:
                continue
            dtype = to_torch_dtype(self.inner.program.dst_info[t.dst_rank][t.dst_tensor].dtype)
            src = source_view(t, self.inner.sources, self.inner.shards, None)
            if delta_scan.scannable(src, dtype, t.transform):
                kinds.add(delta_scan.scan_kind(src, dtype))
        return kinds

    def _scan(self, i: int, t: Any, pos: dict[int, int], records: dict[int, int],
              crcs: dict[int, int] | None) -> int | None:
        """Encode transfer ``i`` with the fused CPU scan (cast, compare, collect in one pass) and
        return its changed elements; None when the scan does not cover it (then the plain
        encoder runs)."""
        if self._pos is None or self._no_scan.get(i):
            return None
        gathered = self.inner.gather.full if self.inner.gather is not None else None
        src = source_view(t, self.inner.sources, self.inner.shards, gathered)  # per sync: never a stale view
        if i not in self._no_scan:
            dtype = to_torch_dtype(self.inner.program.dst_info[t.dst_rank][t.dst_tensor].dtype)
            self._no_scan[i] = not delta_scan.scannable(src, dtype, t.transform)
            if self._no_scan[i]:
                return None
            uint = np.uint16 if transfer_itemsize(t) == 2 else np.uint32
            self._views[i] = (self.base[i].numpy().view(uint), self._scratch[: t.nbytes].numpy().view(uint))
        base, val = self._views[i]
        n = base.shape[0]
        r = delta_scan.scan(src, base, self.chunk_elems, self._pos, val, self.threads, self._pool)  # moves the base
        d = t.dst_rank
        p, k, rec = encode_scanned(self.outbox.outboxes[d], pos[d], i, r, base[:n])
        pos[d] = p
        records[d] += rec
        if crcs is not None:
            crcs[i] = crc_update(0, self.base[i])
        return k

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.outbox is not None:
            self.outbox.close()
        self.inner.close()
