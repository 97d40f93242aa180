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

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.engines.vllm.backend import BACKEND, register_weight_transfer
from fastsync.engines.vllm.weight_transfer import (
    connect_key,
    connected_key,
    describe_key,
    error_text,
    raise_error_text,
    version_key,
)
from fastsync.errors import ConfigError, SyncError
from fastsync.security import job_secret
from fastsync.sync.weight_sync import SyncResult, WeightSync

__all__ = [
    "FastSyncTrainerInitInfo",
    "FastSyncTrainerWeightTransferEngine",
    "ClientEngine",
    "LLMWeightSyncClient",
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
    ``timeout_s``: the deadline of every wait of a set-up or an update. ``verify``: CRC-check
    every version on the engine before the flip.
    """

    backend: ClassVar[str] = BACKEND
    world_size: int | None = None
    control_host: str = DEFAULT_HOST
    control_port: int = 0
    secret: str | None = None
    transport: str = "nixl"
    transport_options: dict | None = None
    timeout_s: float = 60.0
    verify: bool = False

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
        if not isinstance(self.verify, bool):
            raise ConfigError(f"FastSyncTrainerInitInfo.verify must be True or False, got {self.verify!r}")


def describe_error(e: BaseException) -> str:
    """``Type: message``, plus the body of an HTTP error response (vLLM puts the worker's error
    there; ``HTTPVLLMWeightSyncClient`` raises ``requests.HTTPError``, whose message has only the
    status)."""
    text = f"{type(e).__name__}: {e}"
    body = getattr(getattr(e, "response", None), "text", None)
    if isinstance(body, str) and body.strip():
        text += f" ({body.strip()[:800]})"
    return text


class _Call:
    """One client call on its own thread (the vLLM side blocks in it while the trainers work)."""

    def __init__(self, what: str, fn: Callable[[], Any]) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.result: Any = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"fastsync-{what}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # handed to the waiter
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise SyncError(f"vLLM client call {self.what} did not return within {timeout_s:.0f} s")


class ClientEngine:
    """The engine handle :class:`WeightSync` drives (describe, connect, begin/wait update), made
    of a vLLM weight-sync client (anything with its four methods) plus the control store: the
    client carries the calls, the store what they cannot return (the workers' descriptions,
    results and errors)."""

    def __init__(self, client: Any, control: TCPStoreControl, init_info: dict, timeout_s: float) -> None:
        self.client = client
        self.control = control
        self.init_info = dict(init_info)
        self.timeout_s = timeout_s
        self.num_ranks = 0
        self.attempted = 0
        self._init: _Call | None = None
        self._updates: dict[int, _Call] = {}

    def _wait_key(self, key: str, call: _Call | None, what: str, deadline: float) -> bytes:
        """``key``'s value; the worker's own error when it wrote one; the client's error when its
        call failed without one; SyncError at ``deadline``."""
        while True:
            raw = self.control.try_get(key)
            if raw is not None:
                if raw.startswith(b"err:"):
                    raise_error_text(raw, what)
                return raw
            if call is not None and call.done and call.error is not None:
                time.sleep(0.05)  # the worker publishes its error before its RPC returns
                raw = self.control.try_get(key)
                if raw is not None and raw.startswith(b"err:"):
                    raise_error_text(raw, what)
                raise SyncError(f"{what}: vLLM's {call.what} failed: {describe_error(call.error)}") from call.error
            if time.monotonic() >= deadline:
                raise SyncError(f"{what}: no answer under {key!r} within {self.timeout_s:.0f} s")
            time.sleep(0.005)

    def describe(self, options: dict | None = None) -> list[dict]:
        if (options or {}).get("rank_offset", 0):
            raise ConfigError("the fastsync vLLM backend drives one engine per trainer set-up (rank_offset 0)")
        self._init = _Call("init_weight_transfer_engine", lambda: self.client.init_weight_transfer_engine(self.init_info))
        deadline = time.monotonic() + self.timeout_s
        first = json.loads(self._wait_key(describe_key(0), self._init, "vLLM engine rank 0 (describe)", deadline))
        self.num_ranks = int(first["num_ranks"])
        got = [first] + [json.loads(self._wait_key(describe_key(r), self._init, f"vLLM engine rank {r} (describe)",
                                                   deadline)) for r in range(1, self.num_ranks)]
        self.attempted = max(int(d.get("attempted", 0)) for d in got)
        return got

    def connect(self, plan_json: str, options: dict) -> list[dict]:
        assert self._init is not None, "describe() first"
        self.control.set(connect_key(), json.dumps({"plan": plan_json, "options": options}))
        deadline = time.monotonic() + self.timeout_s
        out = [json.loads(self._wait_key(connected_key(r), self._init, f"vLLM engine rank {r} (connect)", deadline))
               for r in range(self.num_ranks)]
        self._init.join(max(deadline - time.monotonic(), 1.0))
        if self._init.error is not None:
            raise SyncError(f"vLLM init_weight_transfer_engine failed after every worker connected: "
                            f"{describe_error(self._init.error)}") from self._init.error
        return out

    def abort(self, e: BaseException) -> None:
        """Trainer rank 0 could not plan: the workers waiting for a plan get the error instead."""
        if self._init is None:
            return
        try:
            self.control.set(connect_key(), error_text(e))
            self._init.join(self.timeout_s)
        except Exception as err:  # the planning error is the one the caller raises
            log.warning("fastsync: the vLLM workers did not give up their set-up cleanly: %s", err)

    def begin_update(self, version: int, timeout_s: float = 60.0) -> int:
        def run() -> None:
            self.client.start_weight_update()
            self.client.update_weights({"version": version, "timeout_s": timeout_s})

        self._updates[version] = _Call(f"update to version {version}", run)
        return version

    def wait_update(self, token: int, timeout_s: float = 60.0) -> list[dict]:
        call = self._updates.pop(token)
        deadline = time.monotonic() + timeout_s + 10.0
        results = [json.loads(self._wait_key(version_key(r, token), call, f"vLLM engine rank {r} (version {token})",
                                             deadline)) for r in range(self.num_ranks)]
        call.join(max(deadline - time.monotonic(), 1.0))
        if call.error is not None:
            raise SyncError(f"vLLM update to version {token}: {describe_error(call.error)}") from call.error
        return results

    def version(self) -> int:
        return self.attempted


class LLMWeightSyncClient:
    """vLLM's client protocol over an in-process ``vllm.LLM`` (vLLM ships HTTP and Ray clients)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


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


def _finished_key(version: int) -> str:
    return f"wt/finished/{version}"


class FastSyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[FastSyncTrainerInitInfo]):
    """vLLM's trainer-side weight-transfer engine for ``backend="fastsync"``; build it with
    ``WeightTransferTrainerFactory.trainer_init`` (see the module doc for an example)."""

    init_info_cls = FastSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, ws: WeightSync, control: TCPStoreControl,
                 store: TCPStoreControl, next_version: int, timeout_s: float) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.ws = ws
        self.control = control
        self._store = store
        self.next_version = next_version
        self.timeout_s = timeout_s
        self.last: SyncResult | None = None

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
                probe = TCPStoreControl.client(port, host=init_info.control_host, secret=secret,
                                               timeout_s=init_info.timeout_s)
                session = probe.get("wt/session", init_info.timeout_s, what="trainer rank 0 (session)").decode()
                store = probe
            else:
                store = TCPStoreControl.client(port, host=init_info.control_host, secret=secret,
                                               timeout_s=init_info.timeout_s)
        assert store is not None
        if rank == 0:
            store.set("wt/session", session)
        control = store.with_prefix(f"wt-{session}")
        handle = None
        if rank == 0:
            handle = ClientEngine(client, control, {"control_port": port, "control_host": init_info.control_host,
                                                    "control_prefix": control.prefix,
                                                    "timeout_s": float(init_info.timeout_s)}, init_info.timeout_s)
        ws = WeightSync(module, rank=rank, world_size=world, control=control, engines=[handle] if handle else [],
                        transport=init_info.transport, transport_options=init_info.transport_options,
                        timeout_s=init_info.timeout_s, name="setup", verify=init_info.verify, control_port=port)
        try:
            ws.setup()
            if handle is not None:  # versions continue from what the engine last attempted
                control.set("wt/base_version", str(handle.attempted))
            base = int(control.get("wt/base_version", init_info.timeout_s * 2, what="trainer rank 0 (base version)"))
        except BaseException as e:
            if handle is not None:
                handle.abort(e)
            ws.close()
            store.close()
            raise
        return cls(client=client, source=source, is_sender=rank == 0, ws=ws, control=control, store=store,
                   next_version=base + 1, timeout_s=float(init_info.timeout_s))

    def send_weights(self, weight_version: str | None = None) -> SyncResult:
        """Write this rank's shards as the next version (every rank, after ``optimizer.step()``);
        rank 0 drives ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``
        (``weight_version``: the string vLLM reports at ``/weight_info``; None keeps vLLM's).
        Returns when every engine serves the new version; SyncError on every rank when it did not
        (the engines keep serving their last version)."""
        version = self.next_version
        self.next_version += 1  # spent even when it fails: a retry is a new version
        key = _finished_key(version)
        try:
            result = self.ws.sync(version)
            if self.is_sender:
                self.client.finish_weight_update(weight_version)
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
