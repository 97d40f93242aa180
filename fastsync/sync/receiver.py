"""Inference side of a sync: land the planned writes, flip the version only when all arrived.

The receiver holds destination tensors given as a plain ``dict[str, torch.Tensor]`` (or a
module's parameters) and never replaces them: new values end up in their existing memory. Each
sync is driven in explicit steps so an engine can run them from its own event loop or worker
RPCs: ``begin(version)`` (fence, announce readiness), ``poll()`` / ``wait(deadline)`` (drive the
transport; also what lets one-sided NIXL writes progress), ``finish()`` (verify, flip). Atomicity
is the landing mode's (see ``fastsync.executor.staging``): ``shadow`` keeps live tensors untouched
until the flip; ``inplace`` writes live memory and restores it from a backup if the sync fails.

Example (inside the inference worker)::

    rx = WeightReceiver(rank=tp_rank, plan=plan, tensors=dict(model.named_parameters()),
                        control=TCPStoreControl.client(port), transport="nixl")
    rx.setup()                              # once: registers memory, publishes addresses
    rx.begin(version)                       # generation paused (or shadow mode)
    while not rx.poll(): ...                # or rx.wait(deadline)
    rx.finish()                             # raises SyncError and keeps the old version if incomplete

One session, two payloads. The lifecycle above (version rule, fence, ``begun``/``flipped`` keys,
sender failures, liveness, deadlines, verification, rollback, metrics and hooks) is this class's
alone; what lands and how it is applied is the version's *payload*: :class:`DensePayload` (the
planned writes, through the landing memory) or the delta payload
(:class:`~fastsync.sync.delta_receiver.DeltaPayload`: streams in per-sender inboxes, applied in
place with an undo log). A :class:`~fastsync.sync.delta_receiver.DeltaReceiver` is this session
with inboxes, choosing the payload per version.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from fastsync import plugins
from fastsync.control import ControlPlane, StoreUnreachable
from fastsync.errors import ConfigError, FastSyncError, PlanError, SyncError
from fastsync.protocol import begun_key, flipped_key, receiver_info_key, sender_crc_key, sender_done_key
from fastsync.sync.handshake import Versions, begun_value, refused_value
from fastsync.executor.metrics import SyncMetrics
from fastsync.layout.limits import check_seconds
from fastsync.executor.program import RecvProgram, compile_recv
from fastsync.sync import liveness
from fastsync.sync.liveness import Heartbeat, PeerWatch
from fastsync.sync.payload import DensePayload, Payload
from fastsync.sync.sender import make_transport
from fastsync.executor.staging import Landing
from fastsync.executor.verify import VerifyMode, compare_checksums, receiver_checksums, verify_mode
from fastsync.plan.types import Plan
from fastsync.transport.base import ReceiverContext, Transport, World

__all__ = ["WeightReceiver", "DensePayload", "Payload"]

log = logging.getLogger(__name__)

_FAILURE_CHECK_S = 0.05
#: Longest one control-plane read may take inside a wait: the wait keeps driving the transport
#: (a link that comes back must let the writes complete) and keeps its own deadline.
_CHECK_TIMEOUT_S = 1.0
#: Bound on publishing a rollback: the engine has already restored its last version.
_PUBLISH_FAILURE_S = 2.0


class WeightReceiver:
    """One engine rank's receiver. ``version`` is the last complete version it serves;
    ``versions.attempted`` the last version it began, complete or not. A version number is spent once
    begun: its control-plane keys and transport notifications may linger after a failure, so a
    retry must use a newer number (``begin`` refuses ``version <= versions.attempted``, see ``fastsync.sync.handshake``)."""

    def __init__(
        self,
        *,
        rank: int,
        plan: Plan,
        tensors: dict[str, torch.Tensor] | torch.nn.Module,
        control: ControlPlane,
        transport: str | Transport = "nixl",
        transport_options: dict | None = None,
        mode: str = "shadow",
        backup: bool = False,
        verify: bool | str = False,
        engine_hash: str | None = None,
        timeout_s: float = 60.0,
        initial_version: int = 0,
        landing: Landing | None = None,
    ) -> None:
        if not 0 <= rank < plan.num_receivers:
            raise ConfigError(f"engine rank {rank} outside the plan's {plan.num_receivers} receivers")
        if engine_hash is not None and engine_hash != plan.engine_hash:
            raise PlanError(
                f"plan was built for engine layout {plan.engine_hash}, engine rank {rank} has {engine_hash}: re-plan"
            )
        check_seconds("timeout_s", timeout_s)
        if isinstance(tensors, torch.nn.Module):
            tensors = {n: p.data for n, p in tensors.named_parameters()}
        self.rank = rank
        self.plan = plan
        self.tensors = tensors
        self.control = control
        self.transport = make_transport(transport, transport_options)
        self.verify = verify  # type: ignore[assignment]  # normalized by the property
        self.last_verify: dict[str, Any] = {}
        self.engine_hash = engine_hash
        self.timeout_s = timeout_s
        self.version = initial_version
        self.versions = Versions(f"engine rank {rank}", initial_version)
        self.landing = landing if landing is not None else Landing(tensors, mode=mode, backup=backup)
        self.program: RecvProgram | None = None
        self._open: int | None = None
        self._metrics: SyncMetrics | None = None
        self._complete = False
        self._last_check = 0.0
        self._deadline: float | None = None  # of the open version's wait, on this rank's own clock
        self._store_error: str = ""  # the last control-plane read that failed during the open version
        self._payload: Payload = DensePayload(self)  # of the open (or last) version
        self.last_stats: dict[str, Any] = {}
        self.last_metrics: SyncMetrics | None = None
        self.heartbeat: Heartbeat | None = None
        self.watch: PeerWatch | None = None

    @property
    def verify(self) -> VerifyMode:
        """What this rank checks before each flip: ``"off"``, ``"sample"`` or ``"full"``
        (``fastsync.executor.verify``); set with a mode or a bool (True: full)."""
        return self._verify

    @verify.setter
    def verify(self, value: bool | str) -> None:
        self._verify = verify_mode(value, f"engine rank {self.rank}: verify")

    def setup(self) -> None:
        """Compile what must arrive, publish plan hash and tensors, register with the transport."""
        self.program = compile_recv(self.plan, self.rank, self.landing.infos)
        info = {
            "plan_hash": self.plan.plan_hash,
            "engine_hash": self.engine_hash,
            "tensors": [i.to_json() for i in self.landing.infos.values()],
        }
        self.control.set(receiver_info_key(self.rank), json.dumps(info))
        ctx = ReceiverContext(self.rank, self.plan, self.program, self.landing, self.control,
                              World(self.plan.num_trainers, self.plan.num_receivers), self.timeout_s)
        self.transport.setup_receiver(ctx)
        if self.heartbeat is None:
            self.heartbeat = Heartbeat(self.control, "engine", self.rank)
        if self.watch is not None:
            self.watch.stop()
        self.watch = PeerWatch(self.control, [("trainer", s) for s in sorted(self.program.by_src)],
                               who=f"engine rank {self.rank}")

    # ---- one sync, step by step -----------------------------------------------------------
    @property
    def open_version(self) -> int | None:
        """The version begun and not yet finished or aborted (None between versions)."""
        return self._open

    def begin(self, version: int, *, dense: bool | None = None, payload: Payload | None = None) -> None:
        """Open ``version``: arm the payload (dense by default: snapshot if backing up, arm the
        transport), tell trainers to write. ``dense``: which kind of payload (None: this
        receiver's own default; a receiver without delta inboxes takes dense versions only);
        ``payload``: one built by a subclass, which then decides the kind."""
        if dense is False and payload is None:
            raise ConfigError(f"engine rank {self.rank}: version {version} as a delta needs a DeltaReceiver "
                              "(WeightSync(delta=True))")
        if self.program is None:
            raise SyncError(f"engine rank {self.rank}: begin() before setup()")
        try:
            if self._open is not None:
                raise SyncError(f"engine rank {self.rank}: version {version} begun while {self._open} is open")
            if version <= self.version:
                raise SyncError(f"engine rank {self.rank}: version {version} is not newer than held {self.version}")
            self.versions.spend(version)
        except SyncError as e:
            self._refuse(version, str(e))
            raise
        pay = payload if payload is not None else DensePayload(self)
        self._deadline, self._store_error = None, ""
        name = self.transport.name if pay.kind == "dense" else f"{self.transport.name}-{pay.kind}"
        m = SyncMetrics(version, "engine", self.rank, name, start=time.time())
        plugins.hook().fastsync_before_sync(version=version, role="engine", rank=self.rank, plan=self.plan)
        pay.begin(version, m)
        self._open, self._metrics, self._complete, self._payload = version, m, False, pay
        try:
            pay.announce(version)
            # the receiver decides whether this version is verified: senders checksum when asked
            self.control.set(begun_key(self.rank, version),
                             begun_value(self.verify, self.transport.endpoint()), timeout_s=self.timeout_s)
        except StoreUnreachable as e:  # nothing was asked of the trainers: give the version up now
            self.abort(f"cannot announce the version: {e}")
            raise SyncError(f"engine rank {self.rank}: version {version} not begun, keeping version {self.version}: "
                            f"{e}") from e

    def _refuse(self, version: int, why: str) -> None:
        """Tell the trainer ranks waiting for ``begun`` that this rank will not begin ``version``
        (bounded; never for the version open here, whose trainers are writing)."""
        if version == self._open:
            return
        try:
            self.control.set(begun_key(self.rank, version), refused_value(why), timeout_s=min(self.timeout_s, 2.0))
        except StoreUnreachable:
            pass

    def poll(self) -> bool:
        """Drive the transport once; True when everything the open version carries landed.
        Raises SyncError early when a trainer reported failure or died with its writes missing."""
        if self._open is None:
            raise SyncError(f"engine rank {self.rank}: poll() with no version open")
        if not self._complete:
            try:
                self._complete = self._payload.poll()
                now = time.monotonic()
                if not self._complete and now - self._last_check > _FAILURE_CHECK_S:
                    self._last_check = now  # control-plane round trips: not on every poll
                    self._check_senders()
                    if self.watch is not None:  # a trainer that already delivered may exit
                        self.watch.check(f"during version {self._open}",
                                         among={("trainer", s) for s in self._payload.missing() if isinstance(s, int)})
            except FastSyncError as e:
                version = self._open
                self.abort(str(e))
                raise SyncError(f"engine rank {self.rank}: version {version} failed, keeping version "
                                f"{self.version}: {e}") from e
        return self._complete

    def begin_as_chosen(self, version: int) -> None:
        """Open ``version`` as trainer rank 0 chose it (a dense receiver has one kind: ``begin``;
        ``DeltaReceiver`` reads the choice). What an engine door calls, whatever the receiver."""
        self.begin(version)

    def expire(self) -> None:
        """End the open version's wait now, from another thread: the waiting thread returns at
        its next poll and ``finish()`` finds the version incomplete (a flip that cannot wait longer)."""
        self._deadline = time.monotonic()

    def wait(self, deadline: float | None = None) -> bool:
        """Poll until complete or ``deadline`` (``time.monotonic()``; default: now + timeout_s)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        self._deadline = deadline
        assert self._metrics is not None
        with self._metrics.stage("wait"):
            while not self.poll():
                if time.monotonic() >= self._deadline:  # (another thread may bring it forward)
                    return False
        return True

    def finish(self) -> int:
        """Flip to the open version if complete (and verified), else keep the old one and raise
        SyncError naming the missing trainer ranks and tensors. Returns the version served."""
        if self._open is None:
            raise SyncError(f"engine rank {self.rank}: finish() with no version open")
        version, m, pay = self._open, self._metrics, self._payload
        assert m is not None and self.program is not None
        try:
            if not self._complete:
                raise SyncError(self._missing_message(version))
            pay.commit(version, m)
        except FastSyncError as e:
            self.abort(str(e))
            raise
        except Exception as e:  # the engine's post-processing, say: rolled back like any failure
            self.abort(f"{type(e).__name__}: {e}")
            raise SyncError(f"engine rank {self.rank}, version {version}: {type(e).__name__}: {e}") from e
        pay.settle()
        self.version = version
        self._open = None
        m.ok = True
        m.end = time.time()
        m.bytes_per_link = pay.link_bytes()
        try:
            self.control.set(flipped_key(self.rank, version), b"ok", timeout_s=self._left(_PUBLISH_FAILURE_S))
        except StoreUnreachable as e:  # serving a complete version; the trainers' wait for it ends at their deadline
            m.error = f"flipped, but could not tell the control store: {e}"
            log.warning("engine rank %d: version %d flipped but not published: %s", self.rank, version, e)
        self.last_metrics = m
        plugins.hook().fastsync_after_sync(version=version, role="engine", rank=self.rank, metrics=m.to_json(), ok=True)
        return version

    def abort(self, reason: str) -> None:
        """Give up the open version: roll back, keep serving ``self.version``."""
        if self._open is None:
            return
        version, m, pay = self._open, self._metrics, self._payload
        self._open = None
        note = ""
        try:
            note = pay.rollback()
        finally:
            assert m is not None
            m.error = reason + note
            m.end = time.time()
            self.last_metrics = m
            try:
                self.control.set(flipped_key(self.rank, version), f"err:{reason}{note}", timeout_s=_PUBLISH_FAILURE_S)
            except StoreUnreachable as e:  # rolled back already; the trainers' deadline covers them
                log.warning("engine rank %d: version %d rolled back, not published: %s", self.rank, version, e)
            plugins.hook().fastsync_after_sync(version=version, role="engine", rank=self.rank, metrics=m.to_json(),
                                               ok=False)

    def prepare(self) -> float:
        """Between syncs (while trainers train): refresh the in-place backup so the next
        ``begin`` costs nothing. Returns the seconds it took (0 when there is nothing to do)."""
        if self._open is not None:
            raise SyncError(f"engine rank {self.rank}: prepare() while version {self._open} is open")
        if self.landing.backup_fresh:
            return 0.0
        t0 = time.perf_counter()
        self.landing.refresh_backup()
        return time.perf_counter() - t0

    def sync(self, version: int, timeout_s: float | None = None, *, dense: bool | None = None) -> int:
        """``begin``, ``wait`` and ``finish`` in one call (``dense`` as for :meth:`begin`)."""
        self.begin(version, dense=dense)
        self.wait(time.monotonic() + (self.timeout_s if timeout_s is None else check_seconds("timeout_s", timeout_s)))
        return self.finish()

    def close(self) -> None:
        if self._open is not None:
            self.abort("receiver closed")
        liveness.stop(self.heartbeat, self.watch)
        self.heartbeat = None
        self.transport.close()

    # ---- helpers --------------------------------------------------------------------------
    def _left(self, at_least: float = 0.05) -> float:
        """Seconds left in the open version's wait (``timeout_s`` when no wait set one)."""
        if self._deadline is None:
            return self.timeout_s
        return max(self._deadline - time.monotonic(), at_least)

    def _check_senders(self) -> None:
        """A trainer rank that published a failure while its part of the open version is missing
        fails the version now (instead of at the deadline)."""
        for s in self._payload.senders():
            try:
                got = self.control.try_get(sender_done_key(s, self._open),
                                           timeout_s=min(self._left(), _CHECK_TIMEOUT_S))
            except StoreUnreachable as e:  # cut off from the store: keep driving the writes until the deadline
                self._store_error = str(e)
                return
            self._store_error = ''
            if got is not None and got.startswith(b"err:") and s in self._payload.missing():
                raise SyncError(
                    f"engine rank {self.rank}, version {self._open}: trainer rank {s} failed "
                    f"({got[4:].decode(errors='replace')}); missing tensors {self._names(s)}"
                )

    def _names(self, src: int, limit: int = 6) -> str:
        assert self.program is not None
        names = self.program.tensors_from(src)
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(repr(n) for n in names[:limit]) + more

    def _missing_message(self, version: int) -> str:
        missing = self._payload.missing()
        parts = [f"trainer rank {s}: {what} (tensors {self._names(s)})" if isinstance(s, int) else f"{s}: {what}"
                 for s, what in sorted(missing.items(), key=lambda kv: (isinstance(kv[0], str), str(kv[0])))]
        notes = []
        if self.watch is not None and self.watch.silent_note():
            notes.append(self.watch.silent_note())
        if self._store_error:
            notes.append(f"the control store did not answer: {self._store_error}")
        return (f"engine rank {self.rank}: version {version} incomplete, keeping version {self.version}; "
                + ("; ".join(parts) if parts else "transport reported incomplete delivery")
                + (f" ({'; '.join(notes)})" if notes else ""))

    def verify_against_senders(self, version: int, ranks: Any, regions: dict[str, torch.Tensor],
                               after: str = "", mode: str | None = None) -> None:
        """Compare the digest (``mode``, default this rank's ``verify``) of every planned destination
        box in ``regions`` with what trainer ranks ``ranks`` published for ``version``; SyncError
        naming the tensors, boxes and trainer ranks that differ (the caller rolls the version back)."""
        assert self.program is not None
        mode = self.verify if mode is None else mode
        t0 = time.perf_counter()
        got = receiver_checksums(self.program, regions, mode, version)  # before the senders' digests: they may still be on the way
        t1 = time.perf_counter()
        expected: dict[int, int] = {}
        deadline = time.monotonic() + self.timeout_s
        for s in ranks:
            raw = self.control.get(sender_crc_key(s, version), max(0.0, deadline - time.monotonic()),
                                   what=f"trainer rank {s} (checksums of version {version})")
            expected.update({int(k): v for k, v in json.loads(raw).items()})
        bad = compare_checksums(self.program, expected, got)
        self.last_verify = {"mode": str(mode), "digest_s": t1 - t0, "senders_s": time.perf_counter() - t1, "ok": not bad}
        if bad:
            raise SyncError(f"engine rank {self.rank}: version {version} failed verification ({mode}){after}: "
                            + "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
                            + f"; rolled back: engine rank {self.rank} keeps version {self.version}")
