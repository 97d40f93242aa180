"""verl checkpoint-engine backend ``fastsync`` (``checkpoint_engine.backend=fastsync``,
``custom_backend_module=fastsync_verl``; the ``engine_kwargs.fastsync`` keys are in
``adapters/verl/README.md``). This file holds sessions and topology only: every session opens a
``TrainerEnd`` / ``RolloutEnd`` (``trainer_end.py``, ``rollout_end.py``), which takes the in-place
path (every trainer rank's FSDP2 shards written into verl's live vLLM weights) or the buffered
full copy (verl's full tensors, each trainer rank sending about 1/N of the bytes). The plan,
buffers and NIXL connections are built on a session's first sync and replayed afterwards.

Order of calls (verl's ``CheckpointEngineManager.update_weights``, every sync)::

    meta = [e.prepare() for e in actors + rollouts]           # ids; rank 0: control plane, version
    a_kw, r_kw = FastSyncCheckpointEngine.build_topology(A, R, meta)
    e.init_process_group(**kw_i)                              # role, rank, sizes, session, version
    await actor.send_weights(per_tensor_param) || async for n, t in rollout.receive_weights(): ...
    e.finalize()
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from fastsync import PAUSE_MODES, ConfigError, Spelling, SyncError, TCPStoreControl, check_pause_mode, check_sync_options
from fastsync import MasterState, assign_session, control_address, join_control, new_member_id, open_control
from fastsync import session_meta, verify_mode
from fastsync_verl.inplace import INPLACE_MODES
from fastsync_verl.rollout_end import Receive, RolloutEnd
from fastsync_verl.server import install as install_server_hook
from fastsync_verl.shards import AdapterDropped, ShardedWeights, install
from fastsync_verl.trainer_end import TrainerEnd

__all__ = ["FastSyncCheckpointEngine"]

_ROLES = ("trainer", "rollout")
_MEGATRON = "verl.workers.engine.megatron.transformer_impl"
#: why a Megatron actor takes the full-tensor path (logged at the session's set-up; ConfigError under
#: trainer_shards='on' or inplace='on')
MEGATRON_NOTICE = ("Megatron actor: verl 0.9.1 hands checkpoint engines full (TP/PP-gathered) tensors from "
                   "MegatronEngine.get_per_tensor_param and exposes the mcore TP/PP/EP shard layout only to its "
                   "delta_sharded backend (get_per_tensor_param_shard); fastsync does not plan from it yet, so "
                   "Megatron actors use the full-tensor path")
_SHARD_MODES = ("auto", "on", "off")
_SPELLING = Spelling(prefix="engine_kwargs.fastsync.", true="true", false="false")  # as verl's YAML writes them
log = logging.getLogger("fastsync_verl")


@CheckpointEngineRegistry.register("fastsync")
class FastSyncCheckpointEngine(CheckpointEngine):
    """One trainer or rollout rank's end of a fastsync weight sync inside verl. The
    ``engine_kwargs.fastsync`` keys are listed in ``adapters/verl/README.md``; each is checked here,
    by name, before anything starts.

    Sessions and versions are handed out by the master trainer rank (``fastsync.host.sessions``):
    it spends a version in every ``prepare`` (failed or not, so a retry never meets the failed
    attempt's control-plane keys or NIXL notifications), and a change of members (verl's
    ``remove_replicas`` / ``add_replicas``) opens a new session in which every rank re-plans; in
    place, a session starts above what its engines hold (``fastsync.host.path_choice``).
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, *, transport: str = "nixl",
                 control_host: str | None = None, control_port: int = 0, timeout_s: float = 120.0,
                 max_transfer_bytes: int | None = None, staging_bytes: int = 64 << 20, verify: bool | str = False,
                 keep_registered: bool = True, trainer_shards: str = "auto", inplace: str = "auto",
                 delta: bool = False, fanout: str = "off", pause_mode: str = "abort", staged: bool = False,
                 **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"checkpoint_engine.engine_kwargs.fastsync: unknown key(s) {sorted(unknown)}")
        if bucket_size <= 0:
            raise ConfigError("checkpoint_engine.update_weights_bucket_megabytes must be positive, "
                              f"got {bucket_size} bytes")
        check_sync_options(_SPELLING, transport=transport, timeout_s=timeout_s, delta=delta, fanout=fanout, staged=staged)
        if trainer_shards not in _SHARD_MODES:
            raise ConfigError(f"engine_kwargs.fastsync.trainer_shards must be one of {_SHARD_MODES}, got {trainer_shards!r}")
        if inplace not in INPLACE_MODES:
            raise ConfigError(f"engine_kwargs.fastsync.inplace must be one of {INPLACE_MODES}, got {inplace!r}")
        check_pause_mode(pause_mode, PAUSE_MODES, "verl's vLLM server", key="engine_kwargs.fastsync.pause_mode")
        self.delta, self.fanout = delta, fanout
        self.pause_mode, self.staged = pause_mode, staged
        self.trainer_shards = trainer_shards
        self.inplace = inplace
        if trainer_shards != "off" and "verl.workers.engine.fsdp.transformer_impl" in sys.modules:
            install()  # an actor process: hand the FSDP2 module over with verl's weights
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.transport = transport
        self.control_host = control_host
        self.control_port = control_port
        self.timeout_s = timeout_s
        self.max_transfer_bytes = max_transfer_bytes
        self.staging_bytes = staging_bytes
        self.verify = verify_mode(verify, "engine_kwargs.fastsync.verify")
        self.keep_registered = keep_registered
        self._server: TCPStoreControl | None = None  # trainer rank 0 only
        self._topology: tuple | None = None
        self._control: TCPStoreControl | None = None
        self._id = new_member_id()
        self._master = MasterState() if is_master else None
        self._session: str | None = None  # the session this rank joined (set up in it or about to)
        self._version = 0  # the version the master handed out for the coming sync
        self._end: TrainerEnd | RolloutEnd | None = None  # this session's end (trainer_end / rollout_end)
        self.last_metrics: dict[str, float] = {}
        self.setups = 0  # sender/receiver set-ups done (one per session this rank synced in)
        self.full_tensor_syncs = 0  # syncs in which this trainer rank consumed verl's full tensors
        self.last_stall_s = 0.0  # rollout leader, in place: generation blocked in the last sync
        self.last_drain_s = 0.0  # rollout leader, pause_mode=wait: the requests in flight finishing first
        self.last_phases: dict[str, float] = {}  # rollout leader, in place: the stall's parts (ServerEngine)
        self.last_paused_here = False  # rollout leader, in place: fastsync paused AsyncLLM (verl had not)
        self.last_path = ""  # "inplace" or "fulltensor": the path the last sync took

    # ---- topology --------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Every rank reports its id and the session it joined. The master trainer rank
        (``is_master``) also starts the control plane once, spends the next version and reports
        the session it leads. Buffers are allocated on the first sync of a session, when the
        tensors' names and shapes are known."""
        if self._master is not None and self._server is None:
            self._server = open_control(host=self.control_host, port=self.control_port, timeout_s=self.timeout_s)
        # the job secret travels with the address through verl's own channel (Ray), never over ours
        return session_meta(self._id, self._session, self._master,
                            control_address(self._server) if self._server is not None else None)

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every rank gets its role, its rank within the role, both world sizes, the control
        plane address, and the session and version the master handed out (see
        ``fastsync.host.sessions``)."""
        a, r = actor_wg_world_size, rollout_world_size
        got = assign_session(a, r, metadata)
        common = lambda n: {"num_trainers": [a] * n, "num_receivers": [r] * n,  # noqa: E731
                            "control": [list(got.control)] * n, "session": [got.session] * n,
                            "version": [got.version] * n, "members": [list(got.members)] * n}
        actor = {"role": ["trainer"] * a, "rank": list(range(a)), **common(a)}
        rollout = {"role": ["rollout"] * r, "rank": list(range(r)), **common(r)}
        return actor, rollout

    def init_process_group(self, *, role: str, rank: int, num_trainers: int, num_receivers: int,
                           control: list, session: str, version: int, members: list[str]) -> None:
        """Take the master's session and version. The same session keeps the plan and the
        registrations; a new one (verl removed, re-added or added replicas, or a set-up failed)
        drops them, and the next sync re-plans and sends the current weights to every rank."""
        if role not in _ROLES:
            raise ConfigError(f"fastsync: role must be one of {_ROLES}, got {role!r}")
        size = num_trainers if role == "trainer" else num_receivers
        if not 0 <= rank < size:
            raise ConfigError(f"fastsync: {role} rank {rank} outside world size {size}")
        index = rank if role == "trainer" else num_trainers + rank
        if len(members) != num_trainers + num_receivers or members[index] != self._id:
            raise ConfigError(f"fastsync: {role} rank {rank} is not the engine the master listed at that rank")
        if version <= self._version:
            raise SyncError(f"fastsync {role} rank {rank}: version {version} handed out again "
                            f"(this rank already took {self._version}); versions come from the master only")
        if self._master is not None:
            self._master.joined(session, members)
        self._version = version
        topology = (role, rank, num_trainers, num_receivers, tuple(control))
        if session == self._session and topology == self._topology and self._control is not None:
            return
        self._reset()
        self._session = session
        self._topology = topology
        self._control = join_control(control, timeout_s=self.timeout_s, server=self._server)

    def describe(self) -> dict[str, Any]:
        """Where this rank stands: role, rank, session, last version handed to it, set-ups."""
        role, rank = (self._topology[0], self._topology[1]) if self._topology else (None, None)
        return {"role": role, "rank": rank, "session": self._session, "version": self._version,
                "setups": self.setups,
                "planned": self._planned()}

    def finalize(self) -> None:
        """Keep plan, buffers and NIXL registrations for the next sync (the point of a static
        plan) unless ``keep_registered=False``."""
        if not self.keep_registered:
            self._reset()
            self._topology = None
            self._session = None

    def close(self) -> None:
        """Release everything, including the control plane on trainer rank 0."""
        self._reset()
        self._topology = None
        self._session = None
        self._server = None

    # ---- trainer side ----------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, float]:
        """This rank's share of the sync (``fastsync_verl.trainer_end``): in place from its FSDP2
        shards, or the full copy (from its shards, else from verl's full tensors, keeping only
        the regions it sends). The first sync of a session plans and sets up. Returns per-rank
        metrics, which verl merges into the trainer's."""
        if isinstance(weights, AdapterDropped):  # before any byte moves, set up or not
            raise ConfigError(weights.refusal(self._topology[1] if self._topology is not None else 0))
        _, rank, num_trainers, num_receivers, _ = self._need("trainer")
        version = self._version  # handed out by the master, spent even if this sync fails
        module, why = self._shard_module(weights, rank)
        if self._end is None:
            self._end = TrainerEnd(self, rank=rank, num_trainers=num_trainers, num_receivers=num_receivers,
                                   control=self._session_control())
        assert isinstance(self._end, TrainerEnd)
        return await self._end.send(weights, module, why, version)

    # ---- trainer side, FSDP2 shards --------------------------------------------------------
    def _shard_module(self, weights: Any, rank: int) -> tuple[Any, str | None]:
        """The FSDP2 module to read shards from and None, or None and why verl's full tensors
        are used (logged)."""
        if self.trainer_shards == "off":
            return None, "engine_kwargs.fastsync.trainer_shards='off'"
        if not isinstance(weights, ShardedWeights) and _MEGATRON in sys.modules:
            why = MEGATRON_NOTICE
        elif not isinstance(weights, ShardedWeights):
            why = (f"verl handed {type(weights).__name__}, not fastsync_verl.shards.ShardedWeights "
                   "(not an FSDP engine, or the hook is not installed in this process)")
        else:
            why = weights.refusal()
            if why is None:
                return weights.module, None
        if self.trainer_shards == "on":
            raise ConfigError(f"fastsync trainer rank {rank}: engine_kwargs.fastsync.trainer_shards='on' but "
                              f"the local shards cannot serve: {why}")
        if self._end is None:
            log.warning("fastsync trainer rank %d: full-tensor path (every parameter gathered): %s", rank, why)
        return None, why

    # ---- rollout side ----------------------------------------------------------------------
    def receive_weights(self, global_steps: int | None = None) -> Receive:
        """What verl hands its server adapter. Iterated (``async for``), it is verl's
        ``(name, tensor)`` stream (full-copy path). verl's vLLM ``ServerAdapter``, hooked by
        ``fastsync_verl.server``, instead calls its ``fastsync_serve``: in place, the replica
        leader drives its server while the trainer ranks write into the live engine tensors."""
        _, rank, num_trainers, num_receivers, _ = self._need("rollout")
        install_server_hook()  # verl's ServerAdapter is imported by now in a rollout worker
        if self._end is None:
            self._end = RolloutEnd(self, rank=rank, num_trainers=num_trainers, num_receivers=num_receivers,
                                   control=self._session_control())
        assert isinstance(self._end, RolloutEnd)
        return Receive(self._end, global_steps, self._version)

    # ---- helpers ---------------------------------------------------------------------------
    def _need(self, role: str) -> tuple:
        if self._topology is None or self._control is None or self._session is None:
            raise SyncError(f"fastsync: {role} side used before init_process_group (or after a failed set-up)")
        if self._topology[0] != role:
            raise SyncError(f"fastsync: {self._topology[0]} rank {self._topology[1]} asked to act as {role}")
        return self._topology

    def _session_control(self) -> TCPStoreControl:
        assert self._control is not None and self._session is not None
        return self._control.with_prefix(f"fsverl/{self._session}")

    def adopt_version(self, version: int) -> int:
        """Take the session's version where trainer rank 0 raised it above what the engines hold
        (``fastsync.host.path_choice``); the master counts on from it. Returns this sync's version."""
        if version > self._version:
            self._version = version
            if self._master is not None:
                self._master.version = max(self._master.version, version)
        return self._version

    def drop_session(self) -> None:
        """After a failed set-up or out-of-step requests: the next sync opens a fresh session in
        which every rank sets up again."""
        self._session = None

    async def set_up(self, setup: Callable[[], Any]) -> None:
        """A session end's set-up, off verl's event loop, counted; a failure drops the session."""
        try:
            await asyncio.to_thread(setup)
        except BaseException:
            self.drop_session()
            raise
        self.setups += 1

    def _planned(self) -> bool:
        end = self._end
        if isinstance(end, TrainerEnd):
            return end.inplace is not None or (end.sender is not None and end.sender.plan is not None)
        return isinstance(end, RolloutEnd) and end.receiver is not None and end.receiver.plan is not None

    def _reset(self) -> None:
        if self._end is not None:
            self._end.close()
        self._end = None
        if self._control is not None and self._control is not self._server:
            self._control = None
