"""Worker side of the ``fastsync`` backend of vLLM's weight-transfer API.

vLLM creates one :class:`FastSyncWeightTransferEngine` per worker when the engine starts with
``--weight-transfer-config '{"backend": "fastsync"}'`` (``WeightTransferEngineFactory``, after the
model is loaded), and drives it through its own calls: ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` or the ``vllm serve``
routes of the same names (``VLLM_SERVER_DEV_MODE=1``). The trainer side is
``fastsync.engines.vllm.weight_transfer_trainer``; the bytes travel as in every fastsync sync
(each trainer rank writes its own shards straight into this worker's memory, planned once), the
vLLM calls carry only small JSON, and everything else goes through fastsync's control store.

What each call does here, over the same :class:`~fastsync.sync.engine_session.EngineSession` and
:class:`~fastsync.engines.vllm.binding.VllmBinding` as the worker extension's verbs (so the
name-map checks, staging of prepacked CPU weights, repacks and rollback are the same code):

1. ``init_transfer_engine`` (once per trainer set-up; a new one replaces the previous set-up
   only once it connected: a refused one leaves the previous trainers working): connect to the trainers' control store
   (host/port from the init info, the job secret from this process's ``$FASTSYNC_JOB_SECRET``:
   it never travels in a vLLM request), describe the live model (``fastsync_describe``: engine
   tensors checked against the live parameters), publish that, wait for trainer rank 0's plan,
   then connect (``fastsync_connect``: the receiver over the live and staging memory, registered
   with the transport). A trainer that cannot plan (names or shapes that do not match) sends its
   error instead of a plan, and this call raises it: nothing was registered, nothing moved.
2. ``start_weight_update``: the fence opens: refuses when not connected, and snapshots the
   parameters that are written in place (so a failed update can restore them) while no write
   is in flight yet. Staged receive (the trainers' ``FastSyncTrainerInitInfo(staged=True)``):
   opens the version trainer rank 0 published under :func:`wt_keys.open_key` (vLLM's call carries
   none) and returns; a thread of this worker drives the receive into staging and shadow
   memory, off the live model, while the engine keeps generating, and publishes under
   :func:`wt_keys.staged_key` when every write landed (or why not). The trainer pauses the engine only
   after that, and ``update_weights`` is then the flip alone.
3. ``update_weights({"version": V})``: opens version V (the trainers write only after this),
   drives the transport until every planned write landed (with a deadline), verifies when asked,
   re-runs the CPU kernels' post-load steps and flips, inside this one call: no forward pass runs
   while a collective RPC is in progress, so generation never sees half-written weights even
   without ``/pause``. On any failure the worker rolls back to its last complete version and the
   call raises, which is also where vLLM's worker ends its update session cleanly (an exception
   out of ``finish_weight_update`` would leave vLLM's session open: see ``Worker.finish_weight_update``
   in vLLM 0.32), so a failed update leaves the model serving its last version and a new session
   can start at once.
   Staged: the flip of the landed version (copy the shadows in, post-process), or the same
   rollback when a write is missing.
4. ``finish_weight_update``: the flip is final; the version string the caller passes to vLLM's
   ``finish_weight_update(weight_version)`` is vLLM's own (``/weight_info``). A staged version
   still open here (the trainer gave it up before the flip, e.g. its pause failed) is abandoned
   and the engine keeps its version.

Pause modes: the workers report which of vLLM's modes this engine can honour
(:func:`engine_pause_modes`) in their description; the trainer refuses any other by name
before it sends the plan. The pause itself is vLLM's (``/pause?mode=``), taken by the trainer.

Every result and error is also published to the control store under the set-up's keys (the
HTTP client keeps only a status code), so the trainer reports the worker's own message.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.engines.vllm import wt_keys
from fastsync.engines.vllm.binding import VllmBinding
from fastsync.engines.vllm.describe import describe_worker
from fastsync.errors import ConfigError, SyncError
from fastsync.sync.engine_session import EngineSession
from fastsync.sync.pause_modes import PAUSE_MODES

__all__ = [
    "FastSyncWeightTransferEngine",
    "FastSyncWeightTransferInitInfo",
    "FastSyncWeightTransferUpdateInfo",
]

log = logging.getLogger(__name__)


# ---- what vLLM parses from the requests ---------------------------------------------------------
@dataclass
class FastSyncWeightTransferInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info`` for the fastsync backend. Trainer rank 0's
    engine builds it; unknown keys are refused by vLLM (``Invalid init_info``)."""

    control_port: int
    control_host: str = DEFAULT_HOST
    control_prefix: str = "fs"
    #: engine rank of this engine's first worker when several engines share one trainer set-up
    rank_offset: int = 0
    #: how long to wait for trainer rank 0's plan after describing
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.control_port, bool) or not isinstance(self.control_port, int) \
                or not 0 < self.control_port <= 65535:
            raise ConfigError(f"init_info control_port must be a TCP port, got {self.control_port!r}")
        if not isinstance(self.control_host, str) or not self.control_host:
            raise ConfigError(f"init_info control_host must be a host name or address, got {self.control_host!r}")
        if not isinstance(self.control_prefix, str) or not self.control_prefix:
            raise ConfigError(f"init_info control_prefix must be a non-empty string, got {self.control_prefix!r}")
        if isinstance(self.rank_offset, bool) or not isinstance(self.rank_offset, int) or self.rank_offset < 0:
            raise ConfigError(f"init_info rank_offset must be an int >= 0, got {self.rank_offset!r}")
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= 86400:
            raise ConfigError(f"init_info timeout_s must be seconds in (0, 86400], got {self.timeout_s!r}")


@dataclass
class FastSyncWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``'s ``update_info``: which fastsync version the trainers are writing."""

    version: int
    timeout_s: float = 60.0
    extra: dict = field(default_factory=dict)  # reserved; must be empty

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ConfigError(f"update_info version must be an int >= 1, got {self.version!r}")
        if not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= 86400:
            raise ConfigError(f"update_info timeout_s must be seconds in (0, 86400], got {self.timeout_s!r}")
        if self.extra:
            raise ConfigError(f"update_info extra: unknown key(s) {sorted(self.extra)}")


def engine_pause_modes() -> tuple[tuple[str, ...], str]:
    """The pause modes this engine can honour, and why not the others: every mode of vLLM's when
    the engine core runs in its own process (``vllm serve``, vLLM's default); with an in-process
    core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) requests step only inside ``generate``, which a
    flip waits for: ``wait`` only (vLLM itself refuses ``wait`` there, and nothing is in flight)."""
    import vllm.envs as envs

    if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        return PAUSE_MODES, ""
    return ("wait",), ("its engine core runs in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): requests "
                       "step only inside generate(), which a flip waits for")


class FastSyncWeightTransferEngine(WeightTransferEngine[FastSyncWeightTransferInitInfo,
                                                        FastSyncWeightTransferUpdateInfo]):
    """vLLM's worker-side weight-transfer engine for ``backend="fastsync"`` (see the module doc
    for what each call does)."""

    init_info_cls = FastSyncWeightTransferInitInfo
    update_info_cls = FastSyncWeightTransferUpdateInfo
    # the draft model of speculative decoding has no fastsync description of its own yet
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        pc = vllm_config.parallel_config
        self._world = int(pc.world_size)
        self._dp_index = int(getattr(pc, "data_parallel_index", 0) or 0)
        # one session for the engine's life: describing again keeps the served version, the staging
        # arena and the snapshot memory
        self._session: EngineSession[VllmBinding] | None = None
        self._connected = False
        self._control: TCPStoreControl | None = None
        self._rank = 0
        self._flipped: int | None = None  # the version this update session flipped to
        self._staged = False  # the trainers connected with staged receive
        self._last_worker = True  # the engine's last worker (tensor-parallel rank): the one that raises

    # ---- init -----------------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> FastSyncWeightTransferInitInfo:
        if not isinstance(init_dict, dict):
            raise ValueError(f"Invalid init_info for {type(self).__name__}: expected a dict, got {type(init_dict).__name__}")
        return super().parse_init_info(init_dict)

    def init_transfer_engine(self, init_info: FastSyncWeightTransferInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = init_info.rank_offset + self._dp_index * self._world + get_tensor_model_parallel_rank()
        self._last_worker = get_tensor_model_parallel_rank() == self._world - 1
        # the job secret comes from this process's environment, never from the request
        control = TCPStoreControl.client(init_info.control_port, host=init_info.control_host,
                                         prefix=init_info.control_prefix)
        pending = wt_keys.describe_key(rank)
        try:
            desc, session = self._describe(init_info.rank_offset + self._dp_index * self._world)
            modes, why_not = engine_pause_modes()
            desc.update(num_ranks=self._world * int(getattr(self.parallel_config, "data_parallel_size", 1) or 1),
                        version=session.version, attempted=session.held(), pause_modes=list(modes),
                        pause_modes_why=why_not)
            control.set(pending, json.dumps(desc))
            pending = wt_keys.connected_key(rank)
            raw = control.get(wt_keys.connect_key(), init_info.timeout_s, what="trainer rank 0 (plan)")
            if raw.startswith(b"err:"):
                wt_keys.raise_error_text(raw, f"engine rank {rank}: the trainers refused the set-up")
            got = json.loads(raw)
            result = session.connect(got["plan"], got["options"])
            control.set(pending, json.dumps(result))
        except BaseException as e:
            try:
                control.set(pending, wt_keys.error_text(e))  # the trainer reports this, not a timeout
            except Exception:
                pass
            control.close()
            # a set-up refused before connecting leaves the previous one (if any) working: its
            # receiver is replaced only by a successful connect
            if pending == wt_keys.connected_key(rank) and (self._session is None or not self._session.connected):
                self._connected = False
            raise
        if self._control is not None:  # the previous trainer set-up's store
            self._control.close()
        self._staged = bool(result.get("staged"))
        self._control, self._rank, self._connected = control, rank, True
        log.info("fastsync weight transfer: engine rank %d connected (%s)", rank, result)

    def _describe(self, rank_offset: int) -> tuple[dict, EngineSession[VllmBinding]]:
        """Describe the live model (the extension's ``fastsync_describe``): the session bound to it."""
        from vllm.distributed import get_tensor_model_parallel_rank

        old = self._session.binding.state if self._session is not None else None
        desc, st = describe_worker(self.model, self.vllm_config, get_tensor_model_parallel_rank(),
                                         {"rank_offset": rank_offset}, old)
        if self._session is None:
            self._session = EngineSession(VllmBinding(st, self.model))
        else:
            self._session.bind(VllmBinding(st, self.model))
        return desc, self._session

    # ---- one update -----------------------------------------------------------------------
    def _state(self, what: str) -> EngineSession[VllmBinding]:
        if not self._connected or self._session is None:
            raise SyncError(f"fastsync weight transfer: {what} before init_weight_transfer_engine connected this "
                            "worker to the trainers")
        if not self._session.connected:
            raise SyncError(f"engine rank {self._session.rank}: fastsync_connect() has not run on this worker")
        return self._session

    def start_weight_update(self) -> None:
        """Dense: take the in-place snapshot (nothing is being written yet). Staged: open the
        version trainer rank 0 published under :func:`open_key` and receive it on a thread of this
        worker while the engine keeps generating; :func:`staged_key` says when it landed."""
        session = self._state("start_weight_update")
        if session.open_version is not None:
            raise SyncError(f"engine rank {session.rank}: version {session.open_version} is still open")
        self._flipped = None
        if not self._staged:
            session.prepare()  # the in-place snapshot, taken while nothing is being written
            return
        assert self._control is not None
        raw = self._control.get(wt_keys.open_key(), 10.0, what="trainer rank 0 (the version to stage)")
        got = json.loads(raw)
        version, timeout_s = int(got["version"]), float(got["timeout_s"])
        control, key, rank = self._control, wt_keys.staged_key(self._rank, version), session.rank

        def publish(error: BaseException | None, received_s: float) -> None:
            # once the receive ended: the trainer pauses only after every rank said so
            try:
                if error is None:
                    control.set(key, json.dumps({"rank": rank, "received_s": received_s}), timeout_s=wt_keys.PUBLISH_S)
                else:
                    control.set(key, wt_keys.error_text(error), timeout_s=wt_keys.PUBLISH_S)
            except Exception as e:  # the trainer's deadline reports it
                log.warning("engine rank %d: staged version %d not published: %s", rank, version, e)

        session.stage(version, timeout_s, on_landed=publish)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse and receive; no ``torch.accelerator.synchronize()`` (the base class's): vLLM-CPU
        has no accelerator (it raises there), and the receiver returns only after every write
        landed and the flip is done."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FastSyncWeightTransferUpdateInfo) -> None:
        session = self._state("update_weights")
        assert self._control is not None
        version = update_info.version
        key = wt_keys.version_key(self._rank, version)
        try:
            if self._flipped is not None:
                raise SyncError(f"engine rank {session.rank}: this update session already flipped to version "
                                f"{self._flipped}; version {version} needs a new start_weight_update")
            t0 = time.perf_counter()
            if self._staged:  # the writes landed while the engine generated: this call is the flip
                if session.open_version != version:
                    raise SyncError(f"engine rank {session.rank}: update_weights for version {version}, but the "
                                    f"staged version open is {session.open_version}")
                got = session.flip(version, min(float(update_info.timeout_s), 10.0))
            else:
                session.begin(version)
                got = session.finish(version, float(update_info.timeout_s))
            got = {k: v for k, v in got.items() if k != "sync"}
            got["update_s"] = time.perf_counter() - t0
        except BaseException as e:
            try:
                self._control.set(key, wt_keys.error_text(e), timeout_s=2.0)
            except Exception:
                pass
            if self._last_worker:
                raise
            # vLLM 0.32's MultiprocExecutor.collective_rpc raises at the first worker reply that is
            # an error and leaves the later workers' replies queued, where the next RPC reads them
            # as its own: every later call is then one reply behind. So only the engine's last
            # worker raises (vLLM ends its session); the others keep theirs open, published why,
            # and the trainer ends their sessions with finish_weight_update.
            log.warning("engine rank %d: version %d refused (%s: %s); the last worker raises it", session.rank, version,
                        type(e).__name__, e)
            return
        self._flipped = version
        try:
            self._control.set(key, json.dumps(got), timeout_s=2.0)
        except Exception as e:  # serving the new version; the trainer's HTTP call still succeeds
            log.warning("engine rank %d: version %d flipped, result not published: %s", session.rank, version, e)

    def finish_weight_update(self) -> None:
        """Ends vLLM's update session. A staged version still open here was never flipped (the
        trainer gave it up, e.g. its pause failed): it is abandoned, the engine keeps serving
        its version, and the call returns normally so that vLLM closes the session (an error
        here would leave it open and refuse every later ``start_weight_update``)."""
        session = self._state("finish_weight_update")
        if session.staging:
            self._abandon(session, "finish_weight_update came before update_weights (the trainer gave the version up)")
        elif session.open_version is not None:  # a begin without its finish (cannot happen through update_weights)
            raise SyncError(f"engine rank {session.rank}: finish_weight_update while version {session.open_version} "
                            "is open")
        self._flipped = None

    def _abandon(self, session: EngineSession[VllmBinding], why: str) -> None:
        """Give up the open staged version: end its receive, keep serving the last version."""
        version = session.abort(why)
        log.warning("engine rank %d: staged version %s abandoned: %s", session.rank, version, why)
        if self._control is not None:
            try:
                abandoned = SyncError(f"engine rank {session.rank}: version {version} abandoned: {why}")
                self._control.set(wt_keys.version_key(self._rank, version), wt_keys.error_text(abandoned), timeout_s=2.0)
            except Exception:
                pass

    # ---- teardown -------------------------------------------------------------------------
    def _close(self) -> None:
        session = self._session
        if session is not None and session.staging:
            self._abandon(session, "the weight-transfer engine shut down")
        if session is not None:
            session.close()
        if self._control is not None:
            self._control.close()
        self._control, self._connected = None, False

    def shutdown(self) -> None:
        self._close()

    def served_version(self) -> int:
        """The fastsync version this worker serves (0: the checkpoint it loaded)."""
        return 0 if self._session is None else self._session.version
