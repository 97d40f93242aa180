"""Trainer side of a sync: compile the plan once, then replay it every step.

Example (on every trainer rank, after ``optimizer.step()``)::

    sender = WeightSender(rank=rank, plan=plan, sources=local_shards, shards=layout,
                          control=TCPStoreControl.client(port), transport="nixl")
    sender.setup()                      # once: checks receivers' plan hash, registers, prepares
    for step in range(num_steps):
        train_step()
        metrics = sender.sync(version=step + 1)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from fastsync import plugins
from fastsync.control import ControlPlane, StoreUnreachable
from fastsync.errors import ConfigError, FastSyncError, PlanError, SyncError
from fastsync.protocol import begun_key, flipped_key, receiver_info_key, sender_crc_key, sender_done_key
from fastsync.sync.handshake import Versions, parse_begun
from fastsync.sync.gather import OwnerGather
from fastsync.sync import liveness
from fastsync.sync.liveness import Heartbeat, PeerWatch, wait_key
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.pack import Packer
from fastsync.executor.program import SendProgram, TensorInfo, compile_send
from fastsync.executor.staging import alloc_touched, dtype_name
from fastsync.executor.verify import Digests, verify_mode
from fastsync.layout.limits import check_bytes, check_count, check_seconds
from fastsync.layout.types import Shard, TrainerLayout
from fastsync.plan.replicate import sender_copies
from fastsync.plan.types import Plan
from fastsync.transport.base import SenderContext, Transport, World

__all__ = ["WeightSender", "make_transport", "RELAY_CHUNK_BYTES"]

#: Write batches of a plan with relays are cut to at most this: a relay forwards what one batch
#: completes, so one batch per share made every hop wait for all of it (on the host rig, a
#: 4-replica chain took 3.59 s per sync against 3.61 s written directly).
RELAY_CHUNK_BYTES = 16 << 20



def make_transport(transport: str | Transport, options: dict | None = None) -> Transport:
    """A transport instance from a registered name (``nixl``, ``torch``, ``rank0``) or as given."""
    if isinstance(transport, Transport):
        if options:
            raise ConfigError("transport_options apply only when the transport is given by name")
        return transport
    return plugins.get_transport_factory(transport)(**(options or {}))


class WeightSender:
    """One trainer rank's sender. ``sources[param]`` is this rank's local buffer for ``param``
    holding the shards ``shards[param]`` describe (``Shard.local_offset`` into it). Pass the whole
    ``TrainerLayout`` as ``shards`` when the plan has owner gathers; they run over
    ``gather_group`` (default: the default torch.distributed group, trainer rank = group rank)."""

    def __init__(
        self,
        *,
        rank: int,
        plan: Plan,
        sources: dict[str, torch.Tensor],
        shards: dict[str, list[Shard]] | TrainerLayout,
        control: ControlPlane,
        transport: str | Transport = "nixl",
        transport_options: dict | None = None,
        staging_bytes: int = 256 << 20,
        num_slots: int = 2,
        direct: bool = True,
        min_direct_run_bytes: int = 16 << 10,
        timeout_s: float = 60.0,
        gather_group: object = None,
        max_chunk_bytes: int | None = None,
    ) -> None:
        if not 0 <= rank < plan.num_trainers:
            raise ConfigError(f"trainer rank {rank} outside the plan's {plan.num_trainers} trainers")
        check_seconds("timeout_s", timeout_s)
        check_bytes("staging_bytes", staging_bytes)
        check_count("num_slots", num_slots, hi=64)
        check_bytes("min_direct_run_bytes", min_direct_run_bytes, lo=0)
        if max_chunk_bytes is not None:
            check_bytes("max_chunk_bytes", max_chunk_bytes)
        if isinstance(shards, TrainerLayout):
            if shards.fingerprint() != plan.trainer_hash:
                raise PlanError(
                    f"plan was built for trainer layout {plan.trainer_hash}, trainer rank {rank} has "
                    f"{shards.fingerprint()}: re-plan"
                )
            layout: TrainerLayout | None = shards
            shards = shards.shards_on(rank)
        else:
            layout = None
        self.layout = layout
        self.gather_group = gather_group
        self.gather: OwnerGather | None = None
        self.rank = rank
        self.plan = plan
        self.sources = sources
        self.shards = shards
        self.control = control
        self.transport = make_transport(transport, transport_options)
        self.staging_bytes = staging_bytes
        self.num_slots = num_slots
        self.direct = direct
        self.min_direct_run_bytes = min_direct_run_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self.world = World(plan.num_trainers, plan.num_receivers)
        self.dsts = sorted({t.dst_rank for _, t in sender_copies(plan, rank)})  # fanout copies included
        self.program: SendProgram | None = None
        self.versions = Versions(f"trainer rank {rank}")
        self.last_metrics: SyncMetrics | None = None
        self.heartbeat: Heartbeat | None = None
        self.watch: PeerWatch | None = None

    def setup(self) -> None:
        """Read every receiver's plan hash and tensors (refusing a mismatch before any byte
        moves), compile the program, allocate staging, prepare the transport."""
        if self.plan.gathers:
            if self.layout is None:
                raise ConfigError(
                    f"trainer rank {self.rank}: the plan gathers {len(self.plan.gathers)} parameter(s) on owner ranks "
                    f"(e.g. {next(iter(self.plan.gathers))!r}); pass shards= as the whole TrainerLayout"
                )
            self.gather = OwnerGather(self.rank, self.plan, self.layout, self.sources, self.gather_group)
            self.gather.check()
        dst_info: dict[int, dict[str, TensorInfo]] = {}
        want = self.plan.plan_hash
        for d in range(self.plan.num_receivers):
            raw = self.control.get(receiver_info_key(d), self.timeout_s, what=f"engine rank {d}")
            info = json.loads(raw)
            if info["plan_hash"] != want:
                raise PlanError(
                    f"engine rank {d} holds plan {info['plan_hash']} (engine layout {info.get('engine_hash')}), "
                    f"trainer rank {self.rank} has plan {want}: refusing to sync; re-plan both sides"
                )
            dst_info[d] = {row[0]: TensorInfo.from_json(row) for row in info["tensors"]}
        src_dtypes = {p: dtype_name(t.dtype) for p, t in self.sources.items()}
        self.program = compile_send(self.plan, self.rank, dst_info, shards=self.shards, src_dtypes=src_dtypes,
                                    staging_bytes=self.staging_bytes, num_slots=self.num_slots, direct=self.direct,
                                    min_direct_run_bytes=self.min_direct_run_bytes,
                                    max_chunk_bytes=self._chunk_cap())
        staged = self.transport.uses_staging and any(not it.direct for c in self.program.chunks for it in c.items)
        # staging on the sources' device: CUDA shards pack (cast, FP8-quantise) into VRAM
        device = next(iter(self.sources.values())).device if self.sources else torch.device("cpu")
        staging = (alloc_touched(self.program.staging_bytes, device) if staged
                   else torch.empty(0, dtype=torch.uint8, device=device))
        packer = Packer(self.program, staging, self.sources, self.shards,
                        gathered=self.gather.full if self.gather is not None else None,
                        check=self.transport.uses_staging)
        ctx = SenderContext(self.rank, self.plan, self.program, packer, self.control, self.world, self.timeout_s,
                            self.sources, self.shards)
        self.transport.setup_sender(ctx)
        if self.heartbeat is None:
            self.heartbeat = Heartbeat(self.control, "trainer", self.rank)
        if self.watch is not None:
            self.watch.stop()
        self.watch = PeerWatch(self.control, [("engine", d) for d in sorted({*self.dsts, *self._waits_for()})],
                               who=f"trainer rank {self.rank}")

    def sync(
        self,
        version: int,
        *,
        verify: bool | None = None,
        timeout_s: float | None = None,
        wait_receivers: bool = False,
        on_chunk: Callable[[int], None] | None = None,
    ) -> SyncMetrics:
        """Send this rank's share of ``version``. Waits (bounded) until every receiver it writes to
        has begun ``version`` (a version number is spent once attempted: a retry after a failure
        needs a newer one), writes, then publishes done (and per-transfer checksums when
        ``verify`` is True, or when it is None and any of those receivers asked for them). With
        ``wait_receivers`` also waits for those receivers to flip, raising if any refused."""
        if self.program is None:
            raise SyncError(f"trainer rank {self.rank}: sync() before setup()")
        self.versions.spend(version)
        timeout = self.timeout_s if timeout_s is None else check_seconds("timeout_s", timeout_s)
        deadline = time.monotonic() + timeout
        with self.version_scope(version, self.transport.name) as m:
            with m.stage("wait_receivers"):
                asked, endpoints = self.wait_begun(version, deadline, self._waits_for())
            self.transport.expect_endpoints(endpoints)  # an engine rank that renewed its endpoint: reconnect first
            crcs = self.digests(version, asked, verify)
            if self.gather is not None and self.transport.uses_staging:  # rank0 assembles its own full tensors
                self.gather.run(deadline, m)
            published: list[bool] = []

            def publish_digests() -> None:  # once every write is posted (NIXL) or done (others): final by then
                if crcs is not None and not published:
                    left = max(deadline - time.monotonic(), 1.0)
                    self.control.set(sender_crc_key(self.rank, version), json.dumps(crcs.crcs), timeout_s=left)
                    published.append(True)

            # the engines verify as soon as the writes land: the digests must not wait for this
            # rank to see its writes complete
            self.transport.send(version, deadline, m, crcs, self._watched(on_chunk, version),
                                on_posted=publish_digests)
            publish_digests()
            left = max(deadline - time.monotonic(), 1.0)  # the writes are done: telling the engines may take a moment
            self.control.set(sender_done_key(self.rank, version), b"ok", timeout_s=left)
            for d, n in self.program.bytes_per_dst().items():
                m.bytes_per_link[f"t{self.rank}->r{d}"] = n
            if wait_receivers:
                self.wait_flips(version, deadline, m)
        return m

    # ---- one trainer-side version, dense or delta (``DeltaSender`` runs its versions through these)
    @contextmanager
    def version_scope(self, version: int, transport: str, *, on_fail: Callable[[], None] | None = None,
                      record: Callable[[SyncMetrics], None] | None = None) -> Iterator[SyncMetrics]:
        """The frame of one version on this trainer rank: its metrics, the before/after-sync hooks,
        and on failure the error (with who went silent, from the liveness watch) published to the
        engines, bounded, and raised as a FastSyncError. ``on_fail`` runs first on a failure;
        ``record`` keeps the metrics (default ``self.last_metrics``)."""
        m = SyncMetrics(version, "trainer", self.rank, transport, start=time.time())
        hook = plugins.hook()
        hook.fastsync_before_sync(version=version, role="trainer", rank=self.rank, plan=self.plan)
        try:
            yield m
            m.ok = True
        except FastSyncError as e:
            if on_fail is not None:
                on_fail()
            note = self.watch.silent_note() if self.watch is not None else ""
            m.error = f"{e} ({note})" if note and note not in str(e) else str(e)
            self._publish_failure(version, m.error)
            if m.error != str(e):
                e.args = (m.error,)  # same error type, with who went silent appended
            raise
        except Exception as e:
            if on_fail is not None:
                on_fail()
            m.error = f"{type(e).__name__}: {e}"
            self._publish_failure(version, m.error)
            raise SyncError(f"trainer rank {self.rank}, version {version}: {m.error}") from e
        finally:
            m.end = time.time()
            if record is not None:
                record(m)
            else:
                self.last_metrics = m
            hook.fastsync_after_sync(version=version, role="trainer", rank=self.rank, metrics=m.to_json(), ok=m.ok)

    def wait_begun(self, version: int, deadline: float, ranks: list[int] | None = None) -> tuple[dict[int, str], dict[int, str]]:
        """Wait (liveness watched, bounded by ``deadline``) for every receiver in ``ranks`` (default:
        those this rank writes to) to begin ``version``: (the verification each asked for, the
        endpoints they announced)."""
        asked: dict[int, str] = {}
        endpoints: dict[int, str] = {}
        for d in (self.dsts if ranks is None else ranks):
            asked[d], endpoints[d] = parse_begun(wait_key(
                self.control, begun_key(d, version), deadline, f"engine rank {d} (begin of version {version})",
                self.watch), f"engine rank {d}", version)
        return asked, endpoints

    def digests(self, version: int, asked: dict[int, str], verify: bool | str | None,
                full_only: bool = False) -> Digests | None:
        """The digests this rank computes for ``version``: per transfer, what its engine rank asked
        for (``asked``, from :meth:`wait_begun`); ``verify`` (True / ``"full"`` / ``"sample"``) adds
        digests for ranks that asked for none, False sends none. ``full_only``: a sampled ask is
        digested in full (delta versions). None when no transfer is digested."""
        if verify is False:
            return None
        extra = "off" if verify is None else verify_mode(verify)
        modes = {d: (a if a != "off" else extra) for d, a in asked.items()}
        if full_only:
            modes = {d: ("full" if m != "off" else m) for d, m in modes.items()}
        if all(m == "off" for m in modes.values()):
            return None
        # a rank this one did not hear from (a relay's child) gets the mode every rank asked for, or full
        asks = {m for m in modes.values() if m != "off"}
        other = asks.pop() if len(asks) == 1 else "full"
        n = len(self.plan.transfers)
        size = self.plan.fanout.replica_size if self.plan.fanout is not None else 0

        def mode_of(i: int) -> str:  # flat index: replica k's copy of transfer b is k * n + b
            k, b = divmod(i, n)
            return modes.get(k * size + self.plan.transfers[b].dst_rank, other)

        one = set(modes.values()) | {other}
        return Digests(version, mode_of, uniform=one.pop() if len(one) == 1 else None)

    def wait_flips(self, version: int, deadline: float, m: SyncMetrics) -> None:
        """Wait (liveness watched, bounded) for every receiver this rank writes to to flip
        ``version``; SyncError naming the first that refused it."""
        with m.stage("wait_flip"):
            for d in self.dsts:
                got = wait_key(self.control, flipped_key(d, version), deadline,
                               f"engine rank {d} (flip of version {version})", self.watch).decode()
                if got != "ok":
                    raise SyncError(f"engine rank {d} refused version {version}: {got}")

    def _chunk_cap(self) -> int | None:
        """Write batches small enough to pipeline where it pays: relays forward batch by batch
        (``max_chunk_bytes`` when given: a peer reload's chains over slow NICs want smaller ones).
        (Smaller batches for FP8 packing were tried on the host rig: packing then contends with
        UCX's progress for the same cores and the sync took as long, 0.78 s against 0.81 s.)"""
        if self.max_chunk_bytes is not None:
            return self.max_chunk_bytes
        return RELAY_CHUNK_BYTES if self.plan.has_relays else None

    def _publish_failure(self, version: int, error: str) -> None:
        """Tell the engines this rank failed ``version`` (bounded: they keep their own deadline)."""
        try:
            self.control.set(sender_done_key(self.rank, version), f"err:{error}", timeout_s=2.0)
        except StoreUnreachable:
            pass

    def _waits_for(self) -> list[int]:
        """Receivers that must have begun before this rank moves bytes: the ones it writes to
        (every receiver when the transport's collective reaches them all, as rank0's does)."""
        if self.transport.rank0_reaches_all and self.rank == 0:
            return list(range(self.plan.num_receivers))
        return self.dsts

    def _watched(self, on_chunk: Callable[[int], None] | None, version: int) -> Callable[[int], None]:
        """``on_chunk`` that first checks the destinations are alive (between chunks)."""
        watch = self.watch

        def call(k: int) -> None:
            if watch is not None:
                watch.check(f"during version {version}")
            if on_chunk is not None:
                on_chunk(k)

        return call

    def close(self) -> None:
        liveness.stop(self.heartbeat, self.watch)
        self.heartbeat = None
        self.transport.close()

