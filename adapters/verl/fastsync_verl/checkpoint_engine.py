"""verl checkpoint-engine backend ``fastsync``: every trainer rank sends its share of the bytes.

verl hands each trainer rank the FULL tensors (``engine.get_per_tensor_param()``: FSDP
``full_tensor()`` per parameter on every rank) and its built-in backends send them all from rank
0. Here the trainer side is a ``replicated:N`` layout: fastsync's planner gives each trainer rank
about 1/N of the bytes (large tensors split at ``max_transfer_bytes``), and each rank WRITEs only
its share straight into every rollout rank's receive buffer (NIXL one-sided WRITE; control plane
a TCPStore hosted by trainer rank 0). Rollout ranks yield ``(name, tensor)`` in verl's order.

The plan, the registered buffers and the NIXL connections are built on the first sync and
replayed afterwards (``finalize`` keeps them unless ``keep_registered=False``).

Enable with::

    actor_rollout_ref.rollout.checkpoint_engine.backend=fastsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=fastsync_verl

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
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from fastsync import (
    DEFAULT_HOST,
    Box,
    ConfigError,
    ParamSpec,
    Shard,
    SyncError,
    TCPStoreControl,
    TrainerLayout,
    WeightReceiver,
    WeightSender,
    box_shape,
    box_slices,
    serve_engine,
    trainer_layout_from_module,
)
from fastsync_verl.inplace import (
    INPLACE_MODES,
    InplaceTrainer,
    decide_mode,
    engine_id,
    publish_rollout_mode,
    read_mode,
)
from fastsync_verl.plan import VerlPlan, build_verl_plan, flat_views, inventory_from_json, inventory_of, send_boxes
from fastsync_verl.shards import ShardedWeights, install, local_shard
from fastsync_verl.server import ServerEngine
from fastsync_verl.server import capability as server_capability
from fastsync_verl.server import install as install_server_hook
from fastsync_verl.session import CONTROL_KEY, ID_KEY, JOINED_KEY, MASTER_KEY, MasterState, assign, new_id

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
log = logging.getLogger("fastsync_verl")


@CheckpointEngineRegistry.register("fastsync")
class FastSyncCheckpointEngine(CheckpointEngine):
    """One trainer or rollout rank's end of a fastsync weight sync inside verl.

    ``engine_kwargs.fastsync`` keys (all optional): ``transport`` ("nixl"; "torch"/"rank0" also
    run), ``control_host`` (address trainer rank 0 binds the control plane to; default 127.0.0.1
    without Ray, Ray's node IP with it), ``control_port`` (0 = free port), ``timeout_s``,
    ``max_transfer_bytes`` (default: 1/16 of a rank's share, at most verl's bucket size),
    ``staging_bytes``, ``verify`` (per-transfer checksums), ``keep_registered``,
    ``trainer_shards`` ("auto": FSDP2 actor ranks send from their local shards, no
    ``full_tensor()``, falling back to verl's full tensors with a logged reason where shards
    cannot serve; "on": refuse instead of falling back; "off": always full tensors), on the
    in-place path ``delta`` (True: after a dense first sync, only what changed; NIXL) and
    ``fanout`` ("off", "auto", "chain", "direct": several identical replicas planned once, fed
    through relays between their ranks or straight from the trainer ranks; see ``WeightSync``).

    Sessions and versions are handed out by the master trainer rank (``fastsync_verl.session``):
    it spends a version in every ``prepare`` (failed or not, so a retry never meets the failed
    attempt's control-plane keys or NIXL notifications), and a change of members (verl's
    ``remove_replicas`` / ``add_replicas``) opens a new session in which every rank re-plans.
    verl's ``global_steps`` is accepted and not used.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, *, transport: str = "nixl",
                 control_host: str | None = None, control_port: int = 0, timeout_s: float = 120.0,
                 max_transfer_bytes: int | None = None, staging_bytes: int = 64 << 20, verify: bool = False,
                 keep_registered: bool = True, trainer_shards: str = "auto", inplace: str = "auto",
                 delta: bool = False, fanout: str = "off", **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"checkpoint_engine.engine_kwargs.fastsync: unknown key(s) {sorted(unknown)}")
        if bucket_size <= 0:
            raise ConfigError("checkpoint_engine.update_weights_bucket_megabytes must be positive, "
                              f"got {bucket_size} bytes")
        if timeout_s <= 0:
            raise ConfigError(f"engine_kwargs.fastsync.timeout_s must be positive, got {timeout_s}")
        if trainer_shards not in _SHARD_MODES:
            raise ConfigError(f"engine_kwargs.fastsync.trainer_shards must be one of {_SHARD_MODES}, got {trainer_shards!r}")
        if inplace not in INPLACE_MODES:
            raise ConfigError(f"engine_kwargs.fastsync.inplace must be one of {INPLACE_MODES}, got {inplace!r}")
        if not isinstance(delta, bool):
            raise ConfigError(f"engine_kwargs.fastsync.delta must be true or false, got {delta!r}")
        if fanout not in ("off", "auto", "chain", "direct"):
            raise ConfigError(f"engine_kwargs.fastsync.fanout must be one of off, auto, chain, direct, got {fanout!r}")
        if delta and fanout == "chain":  # WeightSync's rule, said in verl's words, before anything starts
            raise ConfigError("engine_kwargs.fastsync.delta=true with engine_kwargs.fastsync.fanout=chain: relays forward "
                              "dense batches, not delta pages; use fanout=direct (or auto, which sends deltas direct)")
        self.delta, self.fanout = delta, fanout
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
        self.verify = verify
        self.keep_registered = keep_registered
        self._server: TCPStoreControl | None = None  # trainer rank 0 only
        self._topology: tuple | None = None
        self._control: TCPStoreControl | None = None
        self._id = new_id()
        self._master = MasterState() if is_master else None
        self._session: str | None = None  # the session this rank joined (set up in it or about to)
        self._version = 0  # the version the master handed out for the coming sync
        self._plan: VerlPlan | None = None
        self._sender: WeightSender | None = None
        self._receiver: WeightReceiver | None = None
        self._sources: dict[str, torch.Tensor] = {}  # trainer: the region of each tensor this rank sends
        self._boxes: dict[str, Box] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._flats: list[torch.Tensor] = []
        self.last_metrics: dict[str, float] = {}
        self.setups = 0  # sender/receiver set-ups done (one per session this rank synced in)
        self.full_tensor_syncs = 0  # syncs in which this trainer rank consumed verl's full tensors
        self._local_names: dict[str, str] = {}  # shard path: HF name -> state_dict name
        self._leader: tuple[bool, int] = (False, 0)  # rollout, in place: replica leader?, engine workers
        self._mode: dict | None = None  # this session's path, decided by trainer rank 0 (fastsync_verl.inplace)
        self._inplace: InplaceTrainer | None = None  # trainer, in place
        self._next_request = 1  # rollout leader, in place: the next request number of this session
        self.last_stall_s = 0.0  # rollout leader, in place: generation paused for the last sync
        self.last_paused_here = False  # rollout leader, in place: fastsync paused AsyncLLM (verl had not)
        self.last_path = ""  # "inplace" or "fulltensor": the path the last sync took

    # ---- topology --------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Every rank reports its id and the session it joined. The master trainer rank
        (``is_master``) also starts the control plane once, spends the next version and reports
        the session it leads. Buffers are allocated on the first sync of a session, when the
        tensors' names and shapes are known."""
        meta: dict[str, Any] = {ID_KEY: self._id, JOINED_KEY: self._session}
        if self._master is None:
            return meta
        if self._server is None:
            host = self.control_host if self.control_host is not None else _default_host()
            self._server = TCPStoreControl.server(port=self.control_port, host=host, timeout_s=self.timeout_s)
        # the job secret travels with the address through verl's own channel (Ray), never over ours
        meta[CONTROL_KEY] = [self._server.host, self._server.port, self._server.secret.hex()]
        meta[MASTER_KEY] = self._master.spend()
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every rank gets its role, its rank within the role, both world sizes, the control
        plane address, and the session and version the master handed out (see
        ``fastsync_verl.session``)."""
        a, r = actor_wg_world_size, rollout_world_size
        got = assign(a, r, metadata)
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
        if len(control) != 3:
            raise ConfigError(f"fastsync: control must be [host, port, job secret], got {len(control)} item(s)")
        host, port, secret = control
        if self._server is not None and (host, port) == (self._server.host, self._server.port):
            self._control = self._server
        else:
            self._control = TCPStoreControl.client(port=int(port), host=host, timeout_s=self.timeout_s, secret=secret)

    def describe(self) -> dict[str, Any]:
        """Where this rank stands: role, rank, session, last version handed to it, set-ups."""
        role, rank = (self._topology[0], self._topology[1]) if self._topology else (None, None)
        return {"role": role, "rank": rank, "session": self._session, "version": self._version,
                "setups": self.setups, "planned": self._plan is not None}

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
        """Consume verl's full tensors, copy only the regions this rank sends into its registered
        buffer, WRITE them to every rollout rank. The first sync also plans (holding one host copy
        of the tensors once), publishes the inventory (rank 0) and sets up the sender. Returns
        per-rank metrics, which verl merges into the trainer's."""
        role, rank, num_trainers, num_receivers, _ = self._need("trainer")
        version = self._version  # handed out by the master, spent even if this sync fails
        t0 = time.perf_counter()
        module, why = self._shard_module(weights, rank)
        if self._mode is None:
            self._mode = await asyncio.to_thread(self._trainer_mode, rank, num_receivers, why)
        self.last_path = self._mode["mode"]
        if self._mode["mode"] == "inplace":
            if module is None:
                raise ConfigError(f"fastsync trainer rank {rank}: trainer rank 0 chose the in-place path but this "
                                  f"rank cannot send from FSDP2 shards: {why}")
            return await self._send_inplace(module, rank, num_trainers, version, t0)
        if module is not None:
            if self._sender is None:
                await self._setup_shards(module, rank, num_trainers, num_receivers)
            else:
                self._copy_shards(module, rank)
        elif self._plan is not None and self._plan.sharded:
            raise ConfigError(f"fastsync trainer rank {rank}: this session was planned from FSDP2 shards and verl now "
                              "hands full tensors; set engine_kwargs.fastsync.trainer_shards consistently")
        elif self._sender is None:
            self.full_tensor_syncs += 1
            full: dict[str, torch.Tensor] = {}
            inventory = []
            async for name, tensor in ensure_async_iterator(weights):
                inventory.append(inventory_of(name, tensor))
                full[name] = tensor.detach().to("cpu", copy=True)
            self._plan = build_verl_plan(inventory, num_trainers, num_receivers, self.max_transfer_bytes,
                                         self.bucket_size)
            self._boxes = send_boxes(self._plan.plan, rank)
            dtypes = {n: d for n, _, d in inventory}
            self._flats, self._sources = flat_views([(n, box_shape(b), dtypes[n]) for n, b in self._boxes.items()])
            for name, box in self._boxes.items():
                self._sources[name].copy_(full[name][box_slices(box)])
            del full
            await self._start_sender(rank)
        else:
            self.full_tensor_syncs += 1
            await self._copy_share(weights, rank)
        assert self._sender is not None
        t1 = time.perf_counter()
        m = await asyncio.to_thread(self._sender.sync, version, verify=self.verify or None)
        sent = sum(m.bytes_per_link.values())
        self.last_metrics = {f"fastsync/trainer{rank}/sent_bytes": float(sent),
                             f"fastsync/trainer{rank}/collect_s": t1 - t0,
                             f"fastsync/trainer{rank}/send_s": time.perf_counter() - t1,
                             f"fastsync/trainer{rank}/from_shards": float(module is not None)}
        return self.last_metrics

    def _trainer_mode(self, rank: int, num_receivers: int, why: str | None) -> dict:
        ctl = self._session_control()
        if rank == 0:
            return decide_mode(ctl, num_receivers, why, self.inplace, self.timeout_s * 4)
        return read_mode(ctl, self.timeout_s * 4, f"trainer rank {rank}")

    async def _send_inplace(self, module: Any, rank: int, num_trainers: int, version: int,
                            t0: float) -> dict[str, float]:
        """In place: this rank's shards into its buffer, then fastsync's WeightSync writes them
        into the live engine tensors of every replica (set up on the session's first sync)."""
        if self._inplace is None:
            layout = self._shard_buffers(module, rank, num_trainers)
            assert self._mode is not None
            self._inplace = InplaceTrainer(rank=rank, num_trainers=num_trainers, control=self._session_control(),
                                           leaders=self._mode["leaders"], layout=layout, sources=self._sources,
                                           transport=self.transport, timeout_s=self.timeout_s, verify=self.verify,
                                           delta=self.delta, fanout=self.fanout)
        self._copy_shards(module, rank)
        t1 = time.perf_counter()
        setting_up = not self._inplace.ready
        try:
            m = await asyncio.to_thread(self._inplace.sync, version)
        except BaseException:
            if setting_up:
                self._session = None  # the next sync opens a fresh session: every rank sets up again
            raise
        if setting_up:
            self.setups += 1
        sent = sum((m.get("bytes_per_link") or {}).values()) if isinstance(m, dict) else 0
        self.last_metrics = {f"fastsync/trainer{rank}/sent_bytes": float(sent),
                             f"fastsync/trainer{rank}/collect_s": t1 - t0,
                             f"fastsync/trainer{rank}/send_s": time.perf_counter() - t1,
                             f"fastsync/trainer{rank}/from_shards": 1.0,
                             f"fastsync/trainer{rank}/inplace": 1.0}
        return self.last_metrics

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
        if self._sender is None:
            log.warning("fastsync trainer rank %d: full-tensor path (every parameter gathered): %s", rank, why)
        return None, why

    def _shard_buffers(self, module: Any, rank: int, num_trainers: int) -> Any:
        """The trainer layout from the DTensor placements (identical on every rank, HF names) and
        one flat registered buffer holding this rank's own shards (``self._sources``)."""
        names = ShardedWeights(None, module).hf_names()
        layout = trainer_layout_from_module(module, rank, num_trainers)
        params = {names[n]: ParamSpec(names[n], tuple(p.shape), p.dtype) for n, p in layout.params.items()}
        trainer = TrainerLayout(num_trainers, params, {names[n]: tuple(layout.shards[n]) for n in layout.params},
                                kind="fsdp", description="FSDP2 DTensor shards handed over by verl's actor ranks")
        trainer.validate()
        mine = trainer.shards_on(rank)
        many = [n for n, sh in mine.items() if len(sh) != 1]
        if many:
            raise ConfigError(f"fastsync trainer rank {rank}: parameter {many[0]!r} has {len(mine[many[0]])} shards "
                              "on this rank; expected one (FSDP2 Shard(d))")
        self._boxes = {n: sh[0].box for n, sh in mine.items()}
        self._flats, self._sources = flat_views([(n, box_shape(b), params[n].dtype) for n, b in self._boxes.items()])
        self._local_names = {hf: sd for sd, hf in names.items() if hf in self._boxes}
        return trainer

    async def _setup_shards(self, module: Any, rank: int, num_trainers: int, num_receivers: int) -> None:
        """Plan from the DTensor placements (identical on every rank), keep one flat buffer of
        this rank's own shards, publish the inventory with the shards (rank 0), set up."""
        trainer = self._shard_buffers(module, rank, num_trainers)
        inventory = [(n, p.shape, p.dtype) for n, p in trainer.params.items()]
        self._plan = build_verl_plan(inventory, num_trainers, num_receivers, self.max_transfer_bytes,
                                     self.bucket_size, shards=dict(trainer.shards))
        self._copy_shards(module, rank)
        await self._start_sender(rank)

    async def _start_sender(self, rank: int) -> None:
        """Publish the inventory (rank 0) and set up this rank's sender over ``self._sources``;
        a failed set-up opens a fresh session at the next sync."""
        assert self._plan is not None
        ctl = self._session_control()
        if rank == 0:
            ctl.set("inventory", self._plan.to_json())
        sender = WeightSender(rank=rank, plan=self._plan.plan, sources=self._sources,
                              shards={n: [Shard(rank, b, 0)] for n, b in self._boxes.items()}, control=ctl,
                              transport=self.transport, staging_bytes=self.staging_bytes, timeout_s=self.timeout_s)
        await self._set_up(sender)
        self._sender = sender

    async def _set_up(self, endpoint: Any) -> None:
        """``endpoint.setup()`` (a WeightSender or WeightReceiver) off the event loop; on failure
        close it and drop the session, so the next sync opens a fresh one where every rank sets up."""
        try:
            await asyncio.to_thread(endpoint.setup)
        except BaseException:
            endpoint.close()
            self._session = None
            raise
        self.setups += 1

    def _copy_shards(self, module: Any, rank: int) -> None:
        """This rank's local shards into its registered buffer: a local copy of about 1/N of the
        model (the shards' storage may move between syncs, e.g. with parameter offload)."""
        state = module.state_dict(keep_vars=True)
        for hf, sd in self._local_names.items():
            t = state.get(sd)
            if t is None:
                raise ConfigError(f"fastsync trainer rank {rank}: parameter {sd!r} disappeared since the plan")
            local = local_shard(t)
            dst = self._sources[hf]
            if tuple(local.shape) != tuple(dst.shape) or local.dtype != dst.dtype:
                raise ConfigError(f"fastsync trainer rank {rank}: local shard of {sd!r} is {tuple(local.shape)} "
                                  f"{local.dtype}, the plan expects {tuple(dst.shape)} {dst.dtype}; the model changed")
            dst.copy_(local)

    async def _copy_share(self, weights: Iterable[tuple[str, torch.Tensor]], rank: int) -> None:
        assert self._plan is not None
        inventory = self._plan.inventory
        i = 0
        async for name, tensor in ensure_async_iterator(weights):
            got = inventory_of(name, tensor)
            if i >= len(inventory) or got != inventory[i]:
                want = inventory[i] if i < len(inventory) else "nothing more"
                raise ConfigError(f"fastsync trainer rank {rank}: verl sent {got} where the plan expects {want}; "
                                  "the model changed since the first sync (re-plan by restarting the backend)")
            i += 1
            dst = self._sources.get(name)
            if dst is not None:
                dst.copy_(tensor.detach()[box_slices(self._boxes[name])])
        if i != len(inventory):
            raise ConfigError(f"fastsync trainer rank {rank}: verl sent {i} of the {len(inventory)} planned tensors; "
                              f"first missing {inventory[i][0]!r}")

    # ---- rollout side ----------------------------------------------------------------------
    def receive_weights(self, global_steps: int | None = None) -> "_Receive":
        """What verl hands its server adapter. Iterated (``async for``), it is verl's
        ``(name, tensor)`` stream (full-tensor path). verl's vLLM ``ServerAdapter``, hooked by
        ``fastsync_verl.server``, instead calls its ``fastsync_serve``: in place, the replica
        leader drives its server while the trainer ranks write into the live engine tensors."""
        self._need("rollout")
        install_server_hook()  # verl's ServerAdapter is imported by now in a rollout worker
        return _Receive(self, global_steps)

    async def _serve(self, adapter: Any, fallback: Any, global_steps: int | None) -> Any:
        """The hooked ``ServerAdapter.update_weights``: report this rank's capability, follow
        trainer rank 0's decision: in place (the leader serves the trainers' requests through
        verl's server; other ranks' workers are driven by their leader) or verl's own load from
        the full-tensor stream."""
        _, rank, _, _, _ = self._need("rollout")
        version = self._version
        ctl = self._session_control()
        if self._mode is None:
            ok, why, leader, workers = server_capability(adapter)
            if self.inplace == "off":
                ok, why = False, "engine_kwargs.fastsync.inplace='off'"
            if not ok and self.inplace == "on":
                publish_rollout_mode(ctl, rank, False, why, leader, workers)
                raise ConfigError(f"fastsync rollout rank {rank}: engine_kwargs.fastsync.inplace='on' but: {why}")
            publish_rollout_mode(ctl, rank, ok, why, leader, workers)
            self._mode = await asyncio.to_thread(read_mode, ctl, self.timeout_s * 4, f"rollout rank {rank}")
            self._leader = (leader, workers)
        self.last_path = self._mode["mode"]
        if self._mode["mode"] != "inplace":
            t0 = time.perf_counter()
            try:
                return await fallback(self._receive_full())  # verl's own load (generation paused by verl)
            finally:
                self.last_stall_s = time.perf_counter() - t0
        leader, workers = self._leader
        if not leader:
            return None  # this rank's engine worker is driven through its replica leader's server
        if not adapter._ensure_server_handle():
            raise SyncError(f"fastsync rollout rank {rank}: verl's server adapter has no server handle")
        engine = ServerEngine(adapter.server_handle, ctl, engine_id=engine_id(rank), workers=workers,
                              timeout_s=self.timeout_s, global_steps=global_steps)
        first = self._next_request
        try:
            last = await asyncio.to_thread(serve_engine, engine, ctl, engine_id=engine_id(rank),
                                           idle_timeout_s=self.timeout_s * 4, first=self._next_request)
        except BaseException:
            self._session = None  # requests of this session are out of step: open a fresh one
            raise
        self._next_request = last + 2
        self.last_stall_s = engine.last_stall_s
        self.last_paused_here = engine.last_paused_here
        if engine.last_version != version:
            raise SyncError(f"fastsync rollout rank {rank}: version {version} was not flipped in verl's server "
                            f"(it serves {engine.last_version}); the trainer ranks' error says why")
        if first == 1:
            self.setups += 1  # the session's first turn: describe and connect ran
        return None

    async def _receive_full(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Land every trainer rank's writes, flip only when all arrived, then yield
        ``(name, tensor)`` in verl's order. The tensors are this rank's receive buffers: the
        consumer copies them (into vLLM) before the next sync overwrites them."""
        _, rank, num_trainers, num_receivers, _ = self._need("rollout")
        version = self._version  # handed out by the master, spent even if this sync fails
        if self._mode is None:  # not verl's vLLM ServerAdapter: nothing to drive in place
            why = "the consumer of receive_weights is not verl's vLLM ServerAdapter (SGLang, or another adapter)"
            if self.inplace == "on":
                publish_rollout_mode(self._session_control(), rank, False, why, False, 0)
                raise ConfigError(f"fastsync rollout rank {rank}: engine_kwargs.fastsync.inplace='on' but {why}")
            publish_rollout_mode(self._session_control(), rank, False, why, False, 0)
            self._mode = await asyncio.to_thread(read_mode, self._session_control(), self.timeout_s * 4,
                                                 f"rollout rank {rank}")
            self.last_path = "fulltensor"
        if self._receiver is None:
            ctl = self._session_control()
            raw = await asyncio.to_thread(ctl.get, "inventory", self.timeout_s,
                                          f"trainer rank 0 (inventory), for rollout rank {rank}")
            inventory, shards = inventory_from_json(raw)
            self._plan = build_verl_plan(inventory, num_trainers, num_receivers, self.max_transfer_bytes,
                                         self.bucket_size, shards=shards)
            self._flats, self._tensors = flat_views(self._plan.inventory)
            receiver = WeightReceiver(rank=rank, plan=self._plan.plan, tensors=self._tensors, control=ctl,
                                      transport=self.transport, mode="inplace", verify=self.verify,
                                      engine_hash=self._plan.engine.fingerprint(), timeout_s=self.timeout_s)
            await self._set_up(receiver)
            self._receiver = receiver
        rx = self._receiver
        rx.begin(version)
        deadline = time.monotonic() + self.timeout_s
        while not rx.poll() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        rx.finish()  # SyncError naming the missing trainer ranks and tensors if incomplete
        assert self._plan is not None
        for name, _, _ in self._plan.inventory:
            yield name, self._tensors[name]

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

    def _reset(self) -> None:
        for end in (self._sender, self._receiver):
            if end is not None:
                end.close()
        self._sender = self._receiver = None
        self._plan = None
        self._sources, self._boxes, self._tensors, self._flats = {}, {}, {}, []
        self._local_names = {}
        if self._inplace is not None:
            self._inplace.close()
            self._inplace = None
        self._mode = None
        self._next_request = 1
        if self._control is not None and self._control is not self._server:
            self._control = None


class _Receive:
    """``receive_weights``' result: an async iterable of verl's tensors (full-tensor path) that
    verl's hooked vLLM ``ServerAdapter`` serves in place instead (``fastsync_serve``)."""

    def __init__(self, engine: FastSyncCheckpointEngine, global_steps: int | None) -> None:
        self._engine = engine
        self._global_steps = global_steps

    def __aiter__(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        return self._engine._receive_full()

    async def fastsync_serve(self, adapter: Any, fallback: Any) -> Any:
        return await self._engine._serve(adapter, fallback, self._global_steps)


def _default_host() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return DEFAULT_HOST

