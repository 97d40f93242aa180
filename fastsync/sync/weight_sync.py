"""Trainer side of a weight sync into live inference engines: plan once, replay every step.

:class:`WeightSync` lives on every trainer rank. At :meth:`WeightSync.setup` it reads the
trainer model's sharding (FSDP2 DTensors or a plain module, through the
``fastsync_trainer_layout`` hook), has trainer rank 0 ask every engine to describe its live
parameters (engine tensors per engine rank, checked against the live model by the engine),
builds the static plan once, hands it to the engines (which register their memory with the
transport) and to every trainer rank's sender (which prepares its writes). Every mismatch
(a parameter the engine needs that the trainer lacks, a shape that disagrees, an architecture
without a name map) is raised here, before any byte is written. :meth:`WeightSync.sync` then
replays the plan: the engines fence generation and open the version, every trainer rank writes
its own shards straight into the engines' memory, the engines flip when every write landed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from fastsync.control import ControlPlane
from fastsync.errors import ConfigError, FastSyncError, LayoutError, SyncError, error_from_text, error_text
from fastsync.executor.verify_mode import verify_mode
from fastsync.sync.connect_options import ConnectOptions, StoreAddress
from fastsync.sync.pause_modes import PAUSE_MODES, check_pause_mode
from fastsync.sync.sync_options import check_sync_options
from fastsync.protocol import delta_choice_key, setup_connected_key, setup_plan_key
from fastsync.sync.engine_handle import EngineHandle, SyncResult
from fastsync.sync.handshake import Versions
from fastsync.sync.local_sources import local_sources, where
from fastsync.layout.limits import MAX_WORLD_SIZE, check_count
from fastsync.layout.types import EngineLayout, ParamSpec, TrainerLayout
from fastsync.plan.types import Plan

__all__ = ["WeightSync", "EngineHandle", "SyncResult", "local_sources"]


def _reason_first(err: BaseException | None, engine_err: BaseException) -> BaseException:
    """What :meth:`WeightSync.sync` raises when an engine handle's update failed too: the
    sender's error, unless the sender only ran out of time waiting for an engine's key (its flip
    verdict). The handle then has the engines' own reason (which trainer rank's writes were
    missing), published after the sender's clock ran out because the engines' deadline started
    later (inside vLLM's start call, on a loaded host): that reason, with the timeout chained."""
    if err is None:
        return engine_err
    if getattr(err, "deadline_key", None) is not None and isinstance(engine_err, FastSyncError):
        engine_err.__cause__ = err
        return engine_err
    return err


class WeightSync:
    """Sync a trainer model's weights into live inference engines, every step.

    Create it once per trainer process (every rank of the trainer world), after the model is
    sharded and before training; ``engines`` (handles of the engines to update) on trainer rank 0
    only. ``control`` is the control plane all trainer ranks and engine workers share.

    Example::

        model = fully_shard(AutoModelForCausalLM.from_pretrained(path), mesh=mesh)
        control = TCPStoreControl.client(port, secret=secret)  # port and job secret from the launcher
        engines = [RemoteEngine(control)] if rank == 0 else []
        ws = WeightSync(model, rank=rank, world_size=world, control=control, engines=engines)
        ws.setup()                          # once: layouts, plan, memory registration
        for step in range(1, num_steps + 1):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ws.sync(version=step)           # after optimizer.step(): engines serve `step`
        ws.close()

    ``layout``/``sources``/``params`` replace the model's own description (e.g. a rank-0 holder
    of gathered full tensors, the host frameworks' baseline).

    ``name`` keys this WeightSync's set-up on the control plane: every call of :meth:`setup`
    (on every rank, the same number of times) uses its own keys, so a retried set-up never reads
    an earlier one's plan or error; a second WeightSync on the same control plane needs another
    name. A version number is spent once :meth:`sync` tried it: retry a failed sync with a newer one.

    ``delta=True`` (opt-in; NIXL only): after a dense first sync, each version moves only the
    elements that changed since the last version (``fastsync.sync.delta_sender``): every trainer
    rank keeps the bytes it last sent as the engines hold them (one copy of its planned bytes),
    the engines write the changes into the same live memory inside the same fence, with a
    rollback copy of exactly what was overwritten. Trainer rank 0 chooses per version: dense for
    the first sync after :meth:`setup` and after a failed sync, else a delta; an engine rank that
    does not hold the version the trainer rank encoded against (restarted, rolled back, new) gets
    every element of its links densely inside the stream, never a delta against another base.

    ``staged=True``: the engines keep generating while the writes land (in staging and shadow
    memory, off the live model); an update holds generation back only for the flip (copying the
    shadows in, the CPU repacks): each engine's reply carries ``stall_s``. Costs a shadow and a
    flip snapshot of every in-place parameter (refused at set-up, naming the option, when the
    engine host lacks the memory).

    ``pause_mode`` (vLLM's names): what the engines do with the requests in flight at the pause
    (the flip with ``staged=True``, the whole transfer without). ``wait`` (default: every
    completion comes from one version, none is lost, so RL stays on-policy): they finish on the
    old version, new ones queue; ``abort``: they are aborted (the host resubmits); ``keep``: they
    stay in the engine across the flip and go on with the new weights (their KV recomputed), the
    completion listing each version with the index of its first token. An engine handle that
    cannot pause that way refuses it by name at set-up, before any byte moves; a handle that
    does not declare ``pause_modes`` pauses its own way and is only given the default.

    ``fanout`` (``off`` by default): with several identical engines (``engines=[...]``, one handle
    each, same model and TP), ``auto``/``chain``/``direct`` plan the first replica once and feed
    the others as the planner's cost model chooses (``auto``), through relays between the engines'
    ranks (``chain``: each byte leaves its trainer rank once), or straight from the trainer ranks
    (``direct``); relays need ``transport="nixl"``. With ``delta=True`` relays forward the delta
    streams themselves (``transport/nixl/delta_relay.py``): every replica of a chain applies the
    stream the trainer ranks wrote into its root.

    ``verify`` (``"off"`` by default; True means ``"full"``): after the writes land and before the
    flip, each engine rank digests what it received and compares with the digests the trainer
    ranks computed of what they sent: ``"full"`` every byte (CRC-32), ``"sample"`` a seeded sample
    of 4 KiB blocks of every transfer (about 1 in 32), new for each version (``fastsync.executor.verify``). A
    mismatch rolls the version back on every engine rank and raises SyncError naming the tensor,
    the box, the engine rank and the trainer rank.

    ``lora`` (None: when ``model`` is a PEFT model): a PEFT model's base goes with the first sync
    (and with ``sync(v, base=True)``), its adapter every version, into a spare LoRA slot of each
    engine (``fastsync.sync.peft_sync.PeftWeightSync``, what the constructor then returns).

    ``trace_dir`` (an existing folder): each rank writes ``trainer{rank}.json`` there after every
    sync, a Chrome trace of its phases and, on rank 0, its engines' (``fastsync.sync.trace_dir``;
    merge with ``merge_trace_dir``, open in ui.perfetto.dev). Turns span recording on in the process.
    """

    #: subclasses that take over a kind of model, asked in order by ``WeightSync(...)``:
    #: ``PeftWeightSync`` (``fastsync.sync.peft_sync``, registered when ``fastsync.sync`` or
    #: ``fastsync`` hands out WeightSync) for PEFT models and ``lora=True``
    variants: ClassVar[list[Any]] = []

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> WeightSync:
        if cls is WeightSync:
            for variant in WeightSync.variants:
                if variant.takes(model, kwargs):
                    return super().__new__(variant)
        return super().__new__(cls)

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        rank: int,
        world_size: int,
        control: ControlPlane,
        engines: Sequence[EngineHandle] = (),
        transport: str = "nixl",
        transport_options: dict | None = None,
        timeout_s: float = 60.0,
        name: str = "ws",
        layout: TrainerLayout | None = None,
        sources: dict[str, torch.Tensor] | None = None,
        verify: bool | str = False,
        control_port: int | None = None,
        trace_dir: str | None = None,
        delta: bool = False,
        staged: bool = False,
        fanout: str = "off",
        pause_mode: str = "wait",
        lora: bool | None = None,
    ) -> None:
        if model is not None and hasattr(model, "peft_config"):  # a variant took it unless lora=False
            raise ConfigError("WeightSync got a PEFT model with lora=False (or from fastsync.sync.weight_sync "
                              "directly, where the PEFT variant is not registered): give lora=None/True through "
                              "fastsync.WeightSync (base once, adapter every version) or a merged model "
                              "(model.merge_and_unload())")
        check_count("world_size", world_size, hi=MAX_WORLD_SIZE)
        check_count("rank", rank, lo=0, hi=world_size - 1)
        if not isinstance(transport, str) or not transport.strip():
            raise ConfigError(f"transport must name a registered transport, got {transport!r}")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"name must be a non-empty string, got {name!r}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"trainer rank {rank} outside world size {world_size}")
        if engines and rank != 0:
            raise ConfigError(f"engine handles go to trainer rank 0 only (rank {rank} got {len(engines)})")
        if (layout is None) != (sources is None):
            raise ConfigError("give both layout= and sources=, or neither (then the model describes itself)")
        if model is None and layout is None:
            raise ConfigError("WeightSync needs a model or layout= and sources=")
        check_sync_options(transport=transport, timeout_s=timeout_s, delta=delta, fanout=fanout, staged=staged)
        check_pause_mode(pause_mode, PAUSE_MODES, "WeightSync")
        if control_port is not None:
            check_count("control_port", control_port, hi=65535)
        self.pause_mode = pause_mode
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.control = control
        self.engines = list(engines)
        self.transport = transport
        self.transport_options = transport_options
        self.timeout_s = timeout_s
        self.name = name
        self.verify = verify_mode(verify, "WeightSync(verify=...)")
        self.delta = delta
        self.staged = staged
        self.fanout = fanout
        self._dense_next = True  # the first sync after set-up, and the one after a failure, go dense
        self.last_kind = ""  # "dense" or "delta": what trainer rank 0 chose for the last sync
        self.control_port = control_port if control_port is not None else getattr(control, "port", None)
        self._layout = layout
        self._sources = sources
        self._registered: dict[str, tuple] | None = None  # set by setup(): what the sender registered
        self.plan: Plan | None = None
        self.sender: Any = None
        self.version = 0
        self.versions = Versions(f"trainer rank {rank}")
        self._setups = 0
        self.engine_info: list[list[dict]] = []
        self._engine_params: dict[str, tuple[int, ...]] = {}  # full shapes the engines' own configs imply
        self.setup_s = 0.0
        self._trace = None
        if trace_dir is not None:  # every sync's phases, this rank's and its engines', as a Chrome trace
            from fastsync.sync.trace_dir import TraceDir

            self._trace = TraceDir(trace_dir, rank)

    # ---- set-up ---------------------------------------------------------------------------
    def _trainer_layout(self) -> tuple[TrainerLayout, dict[str, torch.Tensor]]:
        if self._layout is not None:
            assert self._sources is not None
            return self._layout, self._sources
        from fastsync import plugins

        layout = plugins.hook().fastsync_trainer_layout(model=self.model, rank=self.rank, world_size=self.world_size)
        if layout is None:
            raise LayoutError(f"no plugin describes a trainer model of type {type(self.model).__name__}")
        names = [n for n, shards in layout.shards.items() if any(s.rank == self.rank for s in shards)]
        return layout, local_sources(self.model, names, rank=self.rank, world_size=self.world_size)

    def _describe_engines(self) -> tuple[EngineLayout, dict[str, str]]:
        from fastsync.layout.namemap import DEFAULT_ENGINE
        from fastsync.layout.engine_json import engine_tensors_from_json

        tensors: dict[int, dict] = {}
        replica_of: dict[int, int] = {}
        unused: dict[str, str] = {}
        self._engine_params: dict[str, tuple[int, ...]] = {}
        kinds: set[str] = set()
        offset = 0
        self.engine_info = []
        for i, h in enumerate(self.engines):
            got = h.describe({"rank_offset": offset})
            self.engine_info.append(got)
            for w in got:
                tensors[int(w["rank"])] = engine_tensors_from_json(w["tensors"])
                kinds.add(str(w.get("engine", DEFAULT_ENGINE)))
                replica_of[int(w["rank"])] = i
                unused.update(w.get("unused", {}))
                for n, shape in (w.get("params") or {}).items():  # engines that report their model's shapes
                    self._engine_params.setdefault(n, tuple(int(x) for x in shape))
            offset += len(got)
        if sorted(tensors) != list(range(offset)):
            raise LayoutError(f"engines reported engine ranks {sorted(tensors)}, expected 0..{offset - 1}")
        if len(kinds) > 1:
            raise LayoutError(f"engines of different kinds {sorted(kinds)} in one WeightSync")
        kind = kinds.pop() if kinds else DEFAULT_ENGINE
        return EngineLayout(offset, tensors, replica_of, kind=kind, description="live engines"), unused

    def _build_plan(self, layout: TrainerLayout) -> Plan:
        from fastsync.plan.planner import build_plan

        engine, unused = self._describe_engines()
        for n, spec in layout.params.items():
            want = self._engine_params.get(n)
            if want is not None and n not in unused and tuple(spec.shape) != want:
                raise LayoutError(f"trainer parameter {n!r} has shape {tuple(spec.shape)}, the engine's model has "
                                  f"{want}: trainer and engine are not the same model")
        params: dict[str, ParamSpec] = dict(layout.params)
        shards = dict(layout.shards)
        for n in unused:  # e.g. a tied lm_head.weight: the engine shares the embedding
            params.pop(n, None)
            shards.pop(n, None)
        trimmed = TrainerLayout(layout.world_size, params, shards, kind=layout.kind, description=layout.description)
        return build_plan(params, trimmed, engine, fanout=self.fanout)

    def setup(self) -> None:
        """Layouts, plan and transport set-up, once. Raises (on every rank) before any write
        when the trainer's parameters and the engines' disagree; a failure on trainer rank 0
        reaches the other ranks as the same error class, not as a timeout."""
        from fastsync.sync.sender import WeightSender
        from fastsync.layout.types import Shard

        t0 = time.perf_counter()
        self.close()  # a re-setup replaces the previous sender
        self._setups += 1
        if self.rank == 0:
            layout, sources, plan = self._setup_rank0()
        else:
            layout, sources = self._trainer_layout()
            raw = self.control.get(setup_plan_key(self.name, self._setups), self.timeout_s * 4, what="trainer rank 0 (plan)").decode()
            if raw.startswith("err:"):
                raise error_from_text(raw, f"trainer rank {self.rank}: trainer rank 0 could not plan")
            plan = Plan.loads(raw)
            got = self.control.get(setup_connected_key(self.name, self._setups), self.timeout_s * 4, what="engines (connect)").decode()
            if got.startswith("err:"):
                raise error_from_text(got, f"trainer rank {self.rank}: engines refused the plan")
        shards: dict[str, list[Shard]] = layout.shards_on(self.rank)
        # what the sender registers: a sync refuses to send once the model's memory is elsewhere
        self._registered = (None if self._layout is not None or self.model is None else
                            {n: where(t) for n, t in sources.items()})
        kw = dict(rank=self.rank, plan=plan, sources=sources, shards=shards, control=self.control,
                  transport=self.transport, transport_options=self.transport_options, timeout_s=self.timeout_s)
        if self.delta:
            from fastsync.sync.delta_sender import DeltaSender

            sender: Any = DeltaSender(**kw)
        else:
            sender = WeightSender(**kw)
        self._dense_next = True
        try:
            sender.setup()
        except BaseException:
            sender.close()  # no agent or registration outlives a failed set-up
            raise
        self.sender = sender
        self.plan = plan
        self.setup_s = time.perf_counter() - t0

    def _setup_rank0(self) -> tuple[TrainerLayout, dict[str, torch.Tensor], Plan]:
        """Trainer rank 0: check, plan, publish the plan, connect the engines. Any failure is
        published (``err:{Type}:{message}``) where the other ranks wait, then re-raised."""
        try:
            if not self.engines:
                raise ConfigError("trainer rank 0 needs the engine handles (engines=[...])")
            if self.control_port is None:
                raise ConfigError("WeightSync needs control_port= (the engines' workers join the same TCPStore)")
            for h in self.engines:  # before describe and connect: nothing moves
                modes = getattr(h, "pause_modes", None)
                if modes is None and self.pause_mode != "wait":
                    raise ConfigError(f"pause_mode={self.pause_mode!r}: engine handle {type(h).__name__} does not say "
                                      f"which pause modes it can do (no pause_modes); it pauses its own way")
                if modes is not None:
                    check_pause_mode(self.pause_mode, tuple(modes), f"engine handle {type(h).__name__}")
            layout, sources = self._trainer_layout()
            plan = self._build_plan(layout)
            plan_json = plan.dumps()
        except BaseException as e:
            self._publish_error(setup_plan_key(self.name, self._setups), e)
            raise
        options = ConnectOptions(**StoreAddress.of(self.control, port=self.control_port), transport=self.transport,
                                 transport_options=self.transport_options, timeout_s=self.timeout_s,
                                 verify=str(self.verify), delta=self.delta, staged=self.staged,
                                 trace=self._trace is not None).wire()
        self.control.set(setup_plan_key(self.name, self._setups), plan_json)
        try:
            for h in self.engines:
                mine = options if getattr(h, "pause_modes", None) is None else {**options, "pause_mode": self.pause_mode}
                h.connect(plan_json, mine)
        except BaseException as e:
            self._publish_error(setup_connected_key(self.name, self._setups), e)
            raise
        self.control.set(setup_connected_key(self.name, self._setups), b"ok")
        return layout, sources, plan

    def _publish_error(self, key: str, e: BaseException) -> None:
        """``err:{Type}:{message}`` under ``key`` (``errors.error_text``); best effort: the
        original error is what the caller raises."""
        try:
            self.control.set(key, error_text(e))
        except Exception:
            pass

    # ---- per step -------------------------------------------------------------------------
    def sync(self, version: int, *, timeout_s: float | None = None) -> SyncResult:
        """Write this rank's share of the current weights as ``version`` (call after
        ``optimizer.step()``, on every trainer rank). Returns once the engines this rank writes
        to flipped; raises SyncError if any refused (they keep serving their previous version)."""
        if self.sender is None:
            raise SyncError(f"trainer rank {self.rank}: sync() before setup()")
        if version <= self.version:
            raise SyncError(f"trainer rank {self.rank}: version {version} is not newer than {self.version}")
        self._check_registered()
        self.versions.spend(version)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        if self.delta and self.rank == 0:  # one kind per version for every engine rank: rank 0 chooses
            self.last_kind = "dense" if self._dense_next else "delta"
            self.control.set(delta_choice_key(version), self.last_kind)
            self._dense_next = True  # until this version is known to have flipped everywhere
        tokens = [h.begin_update(version, timeout) for h in self.engines]
        err: BaseException | None = None
        metrics: dict = {}
        try:
            metrics = self.sender.sync(version, wait_receivers=True, timeout_s=timeout).to_json()
        except BaseException as e:
            err = e
        results = []
        for h, tok in zip(self.engines, tokens):
            try:
                results.append(h.wait_update(tok, timeout))
            except BaseException as e:
                err = _reason_first(err, e)
        if self._trace is not None:
            self._trace.record(metrics or (self.sender.last_metrics.to_json() if self.sender.last_metrics else {}),
                               results)
        if err is not None:
            raise err
        self._dense_next = False
        self.version = version
        return SyncResult(version, self.rank, time.perf_counter() - t0, metrics, results)

    def _check_registered(self) -> None:
        """SyncError, before any byte moves, when a parameter's local tensor is no longer the memory
        set-up registered (the model replaced, a parameter re-allocated by a reload or an offload):
        fastsync would send bytes that are no longer the model."""
        if self._registered is None or self.model is None:
            return
        names = list(self._registered)
        try:
            now = local_sources(self.model, names, rank=self.rank, world_size=self.world_size)
        except LayoutError as e:
            raise SyncError(f"trainer rank {self.rank}: the model changed since set-up ({e}); call setup() again") from e
        moved = [n for n in names if n not in now or where(now[n]) != self._registered[n]]
        if moved:
            raise SyncError(
                f"trainer rank {self.rank}: {len(moved)} parameter(s) of the model are no longer the memory set-up "
                f"registered ({', '.join(repr(n) for n in moved[:3])}{', ...' if len(moved) > 3 else ''}): the model "
                f"was replaced or its parameters re-allocated (a reload, an offload). Nothing was sent; call setup() "
                f"again on every trainer rank to register the new memory (it re-plans if shapes changed)")

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
