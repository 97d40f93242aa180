"""One engine rank's side of every sync, for any engine: the session an engine's doors are thin
layers over.

An :class:`EngineSession` owns what a version needs on an engine rank: the receiver (dense
:class:`~fastsync.sync.receiver.WeightReceiver` or :class:`~fastsync.sync.delta_receiver.DeltaReceiver`,
chosen at :meth:`~EngineSession.connect`), the landing memory and its rollback snapshot (kept for
the next receiver), the deadline, the staging thread of a staged receive, the undo list of what
the engine's flip hook replaced, and the version served. What it needs from the engine is an
:class:`EngineBinding`: where each planned tensor's writes land, and the hook that makes the
landed bytes the ones the engine computes with (repacks, a loader), run inside the flip.

Example (one engine rank; the trainer's ``WeightSync.sync()`` runs after ``optimizer.step()``)::

    session = EngineSession(binding)              # binding: e.g. fastsync.engines.vllm.binding.VllmBinding
    session.connect(plan_json, options)           # once per trainer set-up: receiver, registration
    # per version, fenced (no forward pass in between):
    session.begin(v); session.finish(v, timeout_s=60.0)
    # or staged (the engine generates while the writes land; only the flip is fenced):
    session.stage(v, timeout_s=60.0); ...; session.landed(v) -> True; session.flip(v)
    session.version                               # v once flipped; the old one after any failure
    session.close()

Which doors use it: the vLLM worker extension's RPC verbs, vLLM's weight-transfer backend and the
peer-reload verbs (``fastsync/engines/vllm/``), each a few lines over these calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from fastsync.errors import SyncError
from fastsync.sync.connect_options import ConnectOptions
from fastsync.sync.engine_landing import EngineDeltaLanding, EngineLanding, StagedEngineLanding, check_staging_memory

__all__ = ["Destinations", "EngineBinding", "EngineSession", "FlipReport", "Restorable"]

log = logging.getLogger(__name__)


class Restorable(Protocol):
    """What a flip hook replaced, saved before it did: ``restore()`` puts it back."""

    def restore(self) -> None: ...


@dataclass(frozen=True)
class Destinations:
    """Where one engine rank's planned tensors land: ``tensors`` by engine tensor name (its live
    memory, or a buffer the flip hook reads), ``live`` the names whose memory the engine computes
    with (snapshotted, or shadowed when staged), ``staged_bytes`` the engine's staging memory."""

    tensors: dict[str, torch.Tensor]
    live: list[str]
    staged_bytes: int = 0


@dataclass
class FlipReport:
    """What the engine's flip hook did in the last flip: seconds per step (``postprocess_s``...,
    reported by name), anything else for the result (``extra``), and its trace spans
    (``(name, start_ns, dur_ns)``, shown inside the receiver's ``apply``)."""

    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    spans: list[tuple[str, int, int]] = field(default_factory=list)


class EngineBinding(Protocol):
    """What an :class:`EngineSession` needs from one engine rank (implemented once per engine,
    e.g. ``fastsync.engines.vllm.binding.VllmBinding``). Pause and resume are the door's: a
    fenced ``begin``/``finish`` or the staged ``flip`` is called where the engine runs no forward."""

    @property
    def rank(self) -> int:
        """This engine rank in the plan."""
        ...

    def destinations(self) -> Destinations:
        """Where writes may land (allocating staging memory on first use)."""
        ...

    def apply(self, undo: list[Restorable], served: int) -> None:
        """Inside the flip, after the data step and before the flip is published: make the landed
        bytes the engine's (repacks, a loader). Append what it replaces to ``undo`` before
        replacing it; on failure restore and empty ``undo``, and raise SyncError saying the
        engine keeps version ``served``."""
        ...

    def flip_report(self) -> FlipReport:
        """What the last :meth:`apply` did."""
        ...

    def committed(self, version: int) -> None:
        """``version`` is final (the undo list is dropped)."""
        ...


B = TypeVar("B", bound=EngineBinding)


class EngineSession(Generic[B]):
    """One engine rank's sync session over an :class:`EngineBinding` (see the module doc)."""

    def __init__(self, binding: B) -> None:
        self.binding = binding
        self._receiver: Any = None
        self._version = 0
        self._open: int | None = None
        self._staged = False  # connected for staged receive
        self._stage: _Stage | None = None  # the open staged version's receive thread
        self._undo: list[Restorable] = []
        self._snapshot_arena: torch.Tensor | None = None  # reused by each receiver's landing
        self.last: dict = {}

    # ---- state ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.binding.rank

    @property
    def version(self) -> int:
        """The version this engine rank serves (0: what it loaded itself)."""
        return self._version

    @property
    def open_version(self) -> int | None:
        """The version begun (or staged) and not yet flipped or abandoned."""
        return self._open

    @property
    def receiver(self) -> Any:
        """The connected receiver (None before :meth:`connect`, after :meth:`close`)."""
        return self._receiver

    @property
    def connected(self) -> bool:
        return self._receiver is not None

    @property
    def staged(self) -> bool:
        """Connected for staged receive (:meth:`stage` / :meth:`flip`)."""
        return self._staged

    @property
    def staging(self) -> bool:
        """A staged version is open (its receive thread started)."""
        return self._open is not None and self._stage is not None

    def held(self) -> int:
        """The newest version served or begun: a version number is spent once begun."""
        rx = self._receiver
        return max(self._version, int(rx.versions.attempted) if rx is not None else 0)

    def bind(self, binding: B) -> None:
        """The engine described again: the new binding, the same served version, receiver and
        snapshot memory."""
        self.binding = binding

    def mark_served(self, version: int) -> None:
        """The engine now serves ``version``, loaded outside a sync (a checkpoint, a peer reload)."""
        self._version = version

    def is_idle(self) -> bool:
        """No version open, here or on the receiver."""
        rx = self._receiver
        return self._open is None and (rx is None or rx.open_version is None)

    # ---- set-up ---------------------------------------------------------------------------
    def connect(self, plan_json: str, options: dict | ConnectOptions, *, initial_version: int | None = None,
                snapshot: bool = True, rank: int | None = None) -> dict:
        """Build this rank's receiver for ``plan_json`` over the binding's destinations and
        register it with the transport (replacing a previous receiver: a failed version stays
        spent). ``initial_version``: the version the receiver starts from (default the one
        served); ``snapshot=False``: no in-place snapshot (nothing worth restoring); ``rank``:
        this engine rank in a plan over several engines (default the binding's)."""
        from fastsync.plan.types import Plan
        from fastsync.sync.receiver import WeightReceiver

        rank = self.rank if rank is None else rank
        opts = options if isinstance(options, ConnectOptions) else ConnectOptions.parse(options)
        if opts.trace:  # WeightSync(trace_dir=...): finish() returns this rank's phases ("sync")
            from fastsync.trace import enable

            enable()
        last_attempted = self._version if initial_version is None else initial_version
        if self._receiver is not None:
            old, self._receiver = self._receiver, None  # never left pointing at a closed receiver
            if initial_version is None:
                last_attempted = max(last_attempted, old.versions.attempted)  # a failed version stays spent
            old.close()
        plan = Plan.loads(plan_json)
        t0 = time.perf_counter()
        d = self.binding.destinations()
        dest, live = d.tensors, d.live
        kw: dict[str, Any] = dict(
            rank=rank, plan=plan, tensors=dest, control=opts.control(),
            transport=opts.transport, transport_options=opts.transport_options,
            timeout_s=opts.timeout_s, verify=opts.verify,
            initial_version=self._version if initial_version is None else initial_version,
        )
        rx: Any
        landing: EngineLanding
        if opts.staged:  # writes land off the live model: the engine keeps generating until the flip
            check_staging_memory(rank, dest, live)
            landing = StagedEngineLanding(dest, live, on_apply=self._apply, arena=self._snapshot_arena)
            rx = WeightReceiver(landing=landing, **kw)
        elif opts.delta:  # WeightSync(delta=True): deltas land in the same memory, same fence
            from fastsync.sync.delta_receiver import DeltaReceiver, inbox_sizes

            landing = EngineDeltaLanding(dest, live if snapshot else [], self._apply, inbox_sizes(plan, rank),
                                         arena=self._snapshot_arena)
            rx = DeltaReceiver(landing=landing, **kw)
        else:
            landing = EngineLanding(dest, live if snapshot else [], on_apply=self._apply, arena=self._snapshot_arena)
            rx = WeightReceiver(landing=landing, **kw)
        # the snapshot arena outlives receivers (a reload or a new trainer set-up connects again):
        # allocated and touched once per engine rank, not per connect
        if snapshot:
            self._snapshot_arena = landing.backup_arena
        rx.versions.attempted = last_attempted
        try:
            rx.setup()
        except BaseException:
            try:  # release the transport agent and registered memory of the half-set-up receiver
                rx.close()
            except Exception as e:  # the setup error is the one to report
                log.warning("fastsync: closing the half-set-up receiver of rank %d failed: %s: %s",
                            rank, type(e).__name__, e)
            raise
        self._receiver, self._staged = rx, opts.staged
        return {
            "rank": rank,
            "transport": rx.transport.name,
            "staged": opts.staged,
            "setup_s": time.perf_counter() - t0,
            "staged_bytes": d.staged_bytes,
            "inplace_bytes": sum(dest[n].numel() * dest[n].element_size() for n in live),
        }

    # ---- one version, fenced ----------------------------------------------------------------
    def begin(self, version: int) -> dict:
        """Open ``version`` (dense, or delta as trainer rank 0 chose it): snapshot what is written
        in place, arm the transport, tell the trainers to write. The door keeps the engine from
        computing until :meth:`finish` returns."""
        rx = self._rx()
        rx.begin_as_chosen(version)
        self._open = version
        return {"rank": self.rank, "version": version}

    def prepare(self) -> float:
        """Between versions: take the in-place snapshot now, so the next :meth:`begin` costs nothing."""
        return float(self._rx().prepare())

    def finish(self, version: int, timeout_s: float, *, waited: bool = False) -> dict:
        """Wait (driving the transport, until ``timeout_s`` from now) until ``version`` landed,
        then verify, apply the binding's flip hook and flip. On failure roll back (the in-place
        snapshot and everything the hook replaced) and raise; the engine keeps its version."""
        rx = self._rx()
        if self._open != version:
            raise SyncError(f"engine rank {self.rank}: finish({version}) but the open version is {self._open}")
        t0 = time.perf_counter()
        self._undo = []
        t_wait = 0.0
        try:
            if not waited:  # (staged: the background thread already drove the receive)
                rx.wait(time.monotonic() + timeout_s)
            t_wait = time.perf_counter() - t0
            # verifies, then the landing's apply runs the binding's hook, then the flip is
            # published; raises SyncError (after rolling back) when incomplete or the hook failed
            rx.finish()
        except BaseException as e:
            self._open = None
            if rx.version == version:  # flipped and published; a step after the flip raised
                self._version, self._undo = version, []
                raise
            for saved in reversed(self._undo):  # what the hook replaced before the failure comes back
                saved.restore()
            self._undo = []
            rx.abort(f"{type(e).__name__}: {e}")  # no-op when finish() already rolled back
            raise
        self._undo = []  # the flip is final: what the hook replaced can go
        self._version, self._open = version, None
        self.binding.committed(version)
        rep = self.binding.flip_report()
        total = time.perf_counter() - t0
        self.last = {"rank": self.rank, "version": version, "wait_s": t_wait,
                     "finish_s": total - t_wait - sum(rep.seconds.values()), **rep.seconds, "total_s": total,
                     "landed_s": getattr(rx.transport, "landed_s", None),  # NIXL: own bytes in (relays may go on)
                     **rep.extra,
                     # this version's in-protocol check before the flip (WeightSync(verify=...)): mode, seconds, ok
                     "verify": dict(rx.last_verify) if rx.verify else {"mode": "off"}}
        m = rx.last_metrics
        if m is not None and m.spans is not None:  # tracing: the phases, the hook's steps inside "apply"
            apply_thread = next((s["thread"] for s in m.spans if s["name"] == "apply"), "repack")
            hook = [{"name": n, "ts_ns": ts, "dur_ns": dur, "thread": apply_thread} for n, ts, dur in rep.spans if ts]
            self.last["sync"] = {**m.to_json(), "spans": m.spans + hook}
        return self.last

    # ---- staged receive: the engine computes on, the pause is only the flip -----------------
    def stage(self, version: int, timeout_s: float,
              on_landed: Callable[[BaseException | None, float], None] | None = None) -> dict:
        """Open ``version`` and receive it on a background thread (the writes land in staging and
        shadow memory, off the live model): returns at once. ``on_landed(error, received_s)``
        runs on that thread when the receive ended (``error`` None: every write landed). Then
        :meth:`landed` until True, then :meth:`flip` inside the engine's pause."""
        self._rx()
        if not self._staged:
            raise SyncError(f"engine rank {self.rank}: fastsync_stage needs fastsync_connect(..., staged=True)")
        got = self.begin(version)
        self._stage = _Stage(self, version, time.monotonic() + timeout_s, timeout_s, on_landed)
        return got

    def landed(self, version: int) -> bool:
        """Whether the staged receive of ``version`` ended (all landed, or it failed/ran out of time)."""
        self._rx()
        if self._open != version or self._stage is None:
            raise SyncError(f"engine rank {self.rank}: no staged version {version} is open (open: {self._open})")
        return self._stage.done.is_set()

    def flip(self, version: int, timeout_s: float = 10.0) -> dict:
        """Inside the pause: end the staged receive (within ``timeout_s``), then verify, copy the
        shadows in, apply the hook and flip, or roll back and keep the served version."""
        self._rx()
        if self._open != version or self._stage is None:
            raise SyncError(f"engine rank {self.rank}: flip({version}) but no staged version {version} is open "
                            f"(open: {self._open})")
        received_s = self._stage.end(timeout_s)
        self._stage = None
        t0 = time.perf_counter()
        got = self.finish(version, 0.0, waited=True)
        return {**got, "received_s": received_s, "flip_s": time.perf_counter() - t0}

    def abort(self, why: str) -> int | None:
        """Give up the open version (a staged one's receive ended first): roll back, keep serving
        the last version. Returns the version given up (None when none was open)."""
        version, stage = self._open, self._stage
        if version is None:
            return None
        if stage is not None:
            stage.end(0.0)  # its receive stops at its next poll
            self._stage = None
        self._rx().abort(why)
        self._open = None
        return version

    def close(self) -> None:
        """Close the receiver (the served version stays; :meth:`connect` may run again)."""
        rx, self._receiver = self._receiver, None
        if rx is not None:
            rx.close()

    # ---- helpers --------------------------------------------------------------------------
    def _rx(self) -> Any:
        if self._receiver is None:
            raise SyncError(f"engine rank {self.rank}: fastsync_connect() has not run on this worker")
        return self._receiver

    def _apply(self) -> None:
        self.binding.apply(self._undo, self._version)


class _Stage:
    """The staged receive of one version: the only thread that touches the transport until the
    flip, its outcome, and when it ended."""

    def __init__(self, session: EngineSession[Any], version: int, deadline: float, timeout_s: float,
                 on_landed: Callable[[BaseException | None, float], None] | None) -> None:
        self.rx, self.version, self.served = session.receiver, version, session.version
        self.rank, self.timeout_s, self.on_landed = session.rank, timeout_s, on_landed
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.t_start = time.perf_counter()
        self.thread = threading.Thread(target=self._receive, args=(deadline,), name=f"fastsync-stage-{version}",
                                       daemon=True)
        self.thread.start()

    def _receive(self, deadline: float) -> None:
        try:
            if not self.rx.wait(deadline):
                self.error = SyncError(f"engine rank {self.rank}: the writes of version {self.version} did not all "
                                       f"land within {self.timeout_s:.1f} s (staged; the engine kept serving "
                                       f"version {self.served})")
        except BaseException as e:  # noqa: BLE001 - the flip reports it
            self.error = e
        self.done.set()
        if self.on_landed is not None:
            self.on_landed(self.error, time.perf_counter() - self.t_start)

    def end(self, timeout_s: float) -> float:
        """Wait up to ``timeout_s`` for the receive to end; still receiving: fail it by its
        deadline (``finish`` sees the version incomplete). Returns the seconds it received."""
        if not self.done.wait(timeout_s):
            self.rx.expire()
            self.done.wait(5.0)
        return time.perf_counter() - self.t_start
