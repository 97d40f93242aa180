"""Trainer side of the ``fastsync`` backend of vLLM's weight-transfer API.

Every trainer rank calls vLLM's factory with fastsync's init info and the usual vLLM client and
source; every rank then calls ``send_weights()`` after each optimizer step::

    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)
    from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo

    model = fully_shard(model, mesh=mesh)                 # FSDP2 (or a plain module, one rank)
    engine = WeightTransferTrainerFactory.trainer_init(
        FastSyncTrainerInitInfo(rank=dist.get_rank()),    # the only required field
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(model))
    for step in range(1, num_steps + 1):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.send_weights(weight_version=f"step-{step}")   # after optimizer.step()
    engine.shutdown()

What it does: the engine is a :class:`~fastsync.sync.weight_sync.WeightSync` whose one engine
handle is vLLM's client (:class:`ClientEngine`). Every rank writes its own FSDP2 shards (the
DTensors' local tensors, the memory the optimizer updates in place) straight into the vLLM
workers; ``full_tensor()`` is never called, unlike ``ModuleSource``'s own iteration, which
fastsync does not use (the source only names the module). Trainer rank 0 hosts the control store
(or joins ``control_port``), drives the four client calls, plans once, and refuses a source whose
names or shapes do not match the engine's model at ``trainer_init``, naming the tensor, before
any byte moves. Defaults come from the process: the world size from ``torch.distributed``, the
job secret from ``$FASTSYNC_JOB_SECRET`` (the vLLM server must have the same one), the control
store on 127.0.0.1.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.engines.vllm.backend import BACKEND, register_weight_transfer
from fastsync.engines.vllm.wt_keys import error_text, raise_error_text
from fastsync.protocol import wt_base_version_key, wt_finished_key, wt_session_key
from fastsync.engines.vllm.wt_client import ClientEngine, LLMWeightSyncClient, describe_error
from fastsync.engines.vllm.wt_pause import check_pauser
from fastsync.errors import ConfigError
from fastsync.executor.verify_mode import verify_mode
from fastsync.sync.pause_modes import DEFAULT_PAUSE_MODE, PAUSE_MODES
from fastsync.security import job_secret
from fastsync.sync.weight_sync import SyncResult, WeightSync

__all__ = [
    "FastSyncTrainerInitInfo",
    "FastSyncTrainerWeightTransferEngine",
    "ClientEngine",
    "LLMWeightSyncClient",
    "describe_error",
]

log = logging.getLogger(__name__)


@dataclass
class FastSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer init info for ``backend="fastsync"``: only ``rank`` (keyword) is required.

    ``world_size``: the trainer ranks that hold the model (default: ``torch.distributed``'s world
    size, 1 without a process group). ``control_host`` / ``control_port``: where trainer rank 0
    starts the control store (port 0: a free one, shared with the other ranks over
    ``torch.distributed``) and where the vLLM workers reach it. ``secret``: the job secret, hex
    (default ``$FASTSYNC_JOB_SECRET``). ``transport``: ``nixl`` (one-sided writes) or ``torch``.
    ``timeout_s``: the deadline of every wait of a set-up or an update. ``verify``: what the
    engine ranks check of every version before the flip: ``"off"``, ``"sample"`` or ``"full"``
    (True: full; ``WeightSync(verify=...)``).

    ``staged`` (default False): the engine keeps generating while the writes land (in staging
    and shadow memory, off the live model); ``start_weight_update`` opens the version and returns,
    and the engine is paused only for ``update_weights``, which is then the flip (copying the
    shadows in, the CPU repacks) and ``finish_weight_update`` (vLLM's version label). A staged
    update that fails never pauses the engine, which keeps serving its last version.

    ``pause_mode`` (vLLM's ``PauseMode``; default ``"wait"``): fastsync's trainer rank 0 pauses
    the engine around the flip (staged) or the whole update (not staged) with vLLM's own
    ``/pause?mode=`` and ``/resume`` (``vllm serve``) or the engine core's ``pause_scheduler``
    (an offline ``LLM``), since vLLM's weight-sync clients carry no pause and only the trainer
    side knows when the writes have landed. ``wait``: requests in flight finish on the old
    weights while new ones queue (every completion from one version: on-policy); ``abort``: they
    end with ``finish_reason "abort"`` (the host resubmits); ``keep``: they stay in the engine
    across the flip, their KV recomputed on the new weights, and their ``weight_versions`` spans
    show where the new version began (pass ``weight_version=`` to ``send_weights``). ``None``:
    fastsync does not pause (the host pauses around ``send_weights`` itself, as with vLLM's
    other backends; a host that has paused is also detected under any mode and keeps its pause).
    A mode the engine cannot honour is refused by name at ``trainer_init``, before any byte moves.
    """

    backend: ClassVar[str] = BACKEND
    world_size: int | None = None
    control_host: str = DEFAULT_HOST
    control_port: int = 0
    secret: str | None = None
    transport: str = "nixl"
    transport_options: dict | None = None
    timeout_s: float = 60.0
    verify: bool | str = False
    staged: bool = False
    pause_mode: str | None = DEFAULT_PAUSE_MODE

    def validate(self) -> None:
        """ConfigError naming the field; called by ``trainer_init`` before anything starts."""
        def bad_int(v: Any) -> bool:
            return isinstance(v, bool) or not isinstance(v, int)

        if bad_int(self.rank) or self.rank < 0:
            raise ConfigError(f"FastSyncTrainerInitInfo.rank must be an int >= 0, got {self.rank!r}")
        if self.world_size is not None and (bad_int(self.world_size) or self.world_size < 1):
            raise ConfigError(f"FastSyncTrainerInitInfo.world_size must be an int >= 1, got {self.world_size!r}")
        if bad_int(self.control_port) or not 0 <= self.control_port <= 65535:
            raise ConfigError(f"FastSyncTrainerInitInfo.control_port must be 0..65535, got {self.control_port!r}")
        if not isinstance(self.control_host, str) or not self.control_host:
            raise ConfigError(f"FastSyncTrainerInitInfo.control_host must be an address, got {self.control_host!r}")
        if not isinstance(self.transport, str) or not self.transport:
            raise ConfigError(f"FastSyncTrainerInitInfo.transport must name a transport, got {self.transport!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) \
                or not 0 < self.timeout_s <= 86400:
            raise ConfigError(f"FastSyncTrainerInitInfo.timeout_s must be seconds in (0, 86400], got {self.timeout_s!r}")
        self.verify = verify_mode(self.verify, "FastSyncTrainerInitInfo.verify")
        if not isinstance(self.staged, bool):
            raise ConfigError(f"FastSyncTrainerInitInfo.staged must be True or False, got {self.staged!r}")
        if self.pause_mode is not None and self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"FastSyncTrainerInitInfo.pause_mode must be one of {list(PAUSE_MODES)} (vLLM's pause "
                              f"modes) or None (the host pauses), got {self.pause_mode!r}")


def _module_of(source: Any) -> torch.nn.Module:
    """The module behind a ``WeightSource``: vLLM's ``ModuleSource`` keeps it as ``_module``
    (vLLM 0.32 ``base.py``); a source of one's own exposes ``module``."""
    for attr in ("module", "_module"):
        m = getattr(source, attr, None)
        if isinstance(m, torch.nn.Module):
            return m
    if isinstance(source, torch.nn.Module):
        return source
    raise ConfigError(f"the fastsync backend needs source=ModuleSource(model) (or a WeightSource with a .module): "
                      f"it writes each rank's own shards of that module; got {type(source).__name__}")


def _join_store(port: int, host: str, secret: bytes, timeout_s: float) -> TCPStoreControl:
    """A trainer rank that knows only ``control_port`` (no process group to say when trainer rank
    0 started its store) retries a refused connection until ``timeout_s``."""
    import time

    from fastsync.errors import SyncError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return TCPStoreControl.client(port, host=host, secret=secret, timeout_s=timeout_s)
        except SyncError as e:
            if "cannot reach the store" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


class FastSyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[FastSyncTrainerInitInfo]):
    """vLLM's trainer-side weight-transfer engine for ``backend="fastsync"``; build it with
    ``WeightTransferTrainerFactory.trainer_init`` (see the module doc for an example)."""

    init_info_cls = FastSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, ws: WeightSync, control: TCPStoreControl,
                 store: TCPStoreControl, next_version: int, timeout_s: float,
                 handle: ClientEngine | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.ws = ws
        self.control = control
        self._store = store
        self.next_version = next_version
        self.timeout_s = timeout_s
        self.last: SyncResult | None = None
        self.handle = handle  # trainer rank 0's: its history has every update's pause figures

    @classmethod
    def trainer_init(cls, init_info: FastSyncTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "FastSyncTrainerWeightTransferEngine":
        import torch.distributed as dist

        if not isinstance(init_info, FastSyncTrainerInitInfo):
            raise ConfigError(f"trainer_init needs FastSyncTrainerInitInfo, got {type(init_info).__name__}")
        init_info.validate()
        module = _module_of(source)
        rank = init_info.rank
        have_pg = dist.is_available() and dist.is_initialized()
        world = init_info.world_size if init_info.world_size is not None else (dist.get_world_size() if have_pg else 1)
        if rank >= world:
            raise ConfigError(f"FastSyncTrainerInitInfo.rank {rank} is outside the trainer world of {world} ranks")
        if world > 1 and init_info.control_port == 0 and not have_pg:
            raise ConfigError("FastSyncTrainerInitInfo.control_port: with several trainer ranks and no "
                              "torch.distributed process group, give the port trainer rank 0 listens on")
        # only rank 0 drives the engine: a client that cannot pause is refused there, by name
        pauser = check_pauser(client, init_info.pause_mode) if rank == 0 else None
        secret = job_secret(init_info.secret)  # ConfigError naming $FASTSYNC_JOB_SECRET when there is none
        port, session = init_info.control_port, ""
        store = None
        if rank == 0:
            store = TCPStoreControl.server(port=port, host=init_info.control_host, secret=secret,
                                           timeout_s=init_info.timeout_s)
            port, session = store.port, secrets.token_hex(4)
        if world > 1 and have_pg:  # every rank learns the store's port and this set-up's key prefix
            box = [(port, session)]
            dist.broadcast_object_list(box, src=0)
            port, session = box[0]
        if rank != 0:
            if not session:  # control_port given, no process group: the prefix comes from the store
                probe = _join_store(port, init_info.control_host, secret, init_info.timeout_s)
                session = probe.get(wt_session_key(), init_info.timeout_s, what="trainer rank 0 (session)").decode()
                store = probe
            else:
                store = TCPStoreControl.client(port, host=init_info.control_host, secret=secret,
                                               timeout_s=init_info.timeout_s)
        assert store is not None
        if rank == 0:
            store.set(wt_session_key(), session)
        control = store.with_prefix(f"wt-{session}")
        handle = None
        if rank == 0:
            handle = ClientEngine(client, control, {"control_port": port, "control_host": init_info.control_host,
                                                    "control_prefix": control.prefix,
                                                    "timeout_s": float(init_info.timeout_s)}, init_info.timeout_s,
                                  pause_mode=init_info.pause_mode, pauser=pauser)
        ws = WeightSync(module, rank=rank, world_size=world, control=control, engines=[handle] if handle else [],
                        transport=init_info.transport, transport_options=init_info.transport_options,
                        timeout_s=init_info.timeout_s, name="setup", verify=init_info.verify, control_port=port,
                        staged=init_info.staged)
        try:
            ws.setup()
            if handle is not None:  # versions continue from what the engine last attempted
                control.set(wt_base_version_key(), str(handle.attempted))
            base = int(control.get(wt_base_version_key(), init_info.timeout_s * 2, what="trainer rank 0 (base version)"))
        except BaseException as e:
            if handle is not None:
                handle.abort(e)
            ws.close()
            store.close()
            raise
        return cls(client=client, source=source, is_sender=rank == 0, ws=ws, control=control, store=store,
                   next_version=base + 1, timeout_s=float(init_info.timeout_s), handle=handle)

    def send_weights(self, weight_version: str | None = None) -> SyncResult:
        """Write this rank's shards as the next version (every rank, after ``optimizer.step()``);
        rank 0 drives ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``
        (``weight_version``: the string vLLM reports at ``/weight_info`` and labels the new tokens
        with, set inside the pause; None keeps vLLM's). Returns when every engine serves the new
        version; SyncError on every rank when it did not (the engines keep serving their last
        version). A ``source`` replaced since ``trainer_init`` is registered afresh first (every
        trainer rank must have replaced its own); a model whose parameters were re-allocated under
        the same source is refused by name before any byte moves (``WeightSync.sync``). On rank 0, ``updates[-1]`` then has the update's ``transfer_s``, ``stall_s``,
        ``drain_s`` and ``paused_by``."""
        module = _module_of(self.source)
        if module is not self.ws.model:
            # vLLM's full-resync backends read ``self.source`` every round: a source replaced since
            # trainer_init is followed (re-registered and re-planned, on every trainer rank, which
            # must all have replaced theirs), never answered with the old module's memory
            self.ws.model = module
            self.ws.setup()
        version = self.next_version
        self.next_version += 1  # spent even when it fails: a retry is a new version
        key = wt_finished_key(version)
        if self.handle is not None:
            self.handle.label = weight_version
        try:
            result = self.ws.sync(version)
        except BaseException as e:
            if self.is_sender:
                try:
                    self.control.set(key, error_text(e), timeout_s=2.0)
                except Exception:
                    pass
            raise
        if self.is_sender:
            self.control.set(key, b"ok")
        else:
            raw = self.control.get(key, self.timeout_s, what=f"trainer rank 0 (finish of version {version})")
            if raw.startswith(b"err:"):
                raise_error_text(raw, f"trainer rank {self.ws.rank}: version {version}")
        self.last = result
        return result

    @property
    def updates(self) -> list[dict]:
        """Trainer rank 0: one record per update (``ClientEngine.history``); [] on other ranks."""
        return self.handle.history if self.handle is not None else []

    @property
    def version(self) -> int:
        """The last fastsync version this engine sent (0 before the first)."""
        return self.ws.version

    def shutdown(self) -> None:
        self.ws.close()
        if self.is_sender:
            stop = getattr(self.client, "shutdown_weight_transfer_engine", None)
            if callable(stop):
                try:
                    stop()
                except Exception as e:  # best effort: the trainer is going away
                    log.warning("fastsync: shutdown_weight_transfer_engine failed: %s", e)
        self._store.close()


register_weight_transfer()  # importing the init info makes the trainer factory know the backend
