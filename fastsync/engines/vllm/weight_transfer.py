"""Worker side of the ``fastsync`` backend of vLLM's weight-transfer API.

vLLM creates one :class:`FastSyncWeightTransferEngine` per worker when the engine starts with
``--weight-transfer-config '{"backend": "fastsync"}'`` (``WeightTransferEngineFactory``, after the
model is loaded), and drives it through its own calls: ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` or the ``vllm serve``
routes of the same names (``VLLM_SERVER_DEV_MODE=1``). The trainer side is
``fastsync.engines.vllm.weight_transfer_trainer``; the bytes travel as in every fastsync sync
(each trainer rank writes its own shards straight into this worker's memory, planned once), the
vLLM calls carry only small JSON, and everything else goes through fastsync's control store.

What each call does here, reusing :class:`~fastsync.engines.vllm.extension.FastSyncWorkerExtension`
(its describe/connect/begin/finish/postprocess run unchanged on a view of this worker, so the
name-map checks, staging of prepacked CPU weights, repacks and rollback are the extension's own):

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
   is in flight yet.
3. ``update_weights({"version": V})``: opens version V (the trainers write only after this),
   drives the transport until every planned write landed (with a deadline), verifies when asked,
   re-runs the CPU kernels' post-load steps and flips, inside this one call: no forward pass runs
   while a collective RPC is in progress, so generation never sees half-written weights even
   without ``/pause``. On any failure the worker rolls back to its last complete version and the
   call raises, which is also where vLLM's worker ends its update session cleanly (an exception
   out of ``finish_weight_update`` would leave vLLM's session open: see ``Worker.finish_weight_update``
   in vLLM 0.32), so a failed update leaves the model serving its last version and a new session
   can start at once.
4. ``finish_weight_update``: the flip is final; the version string the caller passes to vLLM's
   ``finish_weight_update(weight_version)`` is vLLM's own (``/weight_info``).

Every result and error is also published to the control store under the set-up's keys (the
HTTP client keeps only a status code), so the trainer reports the worker's own message.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.engines.vllm.extension import FastSyncWorkerExtension
from fastsync.errors import ConfigError, FastSyncError, SyncError

__all__ = [
    "FastSyncWeightTransferEngine",
    "FastSyncWeightTransferInitInfo",
    "FastSyncWeightTransferUpdateInfo",
    "describe_key",
    "connect_key",
    "connected_key",
    "version_key",
    "error_text",
]

log = logging.getLogger(__name__)


# ---- the set-up's control-plane keys (under the session's prefix) --------------------------------
def describe_key(engine_rank: int) -> str:
    """An engine rank's description (JSON), or ``err:{Type}:{message}``."""
    return f"wt/engine/{engine_rank}/describe"


def connect_key() -> str:
    """Trainer rank 0's plan and connect options (JSON), or ``err:{Type}:{message}``."""
    return "wt/connect"


def connected_key(engine_rank: int) -> str:
    """An engine rank's connect result (JSON), or ``err:{Type}:{message}``."""
    return f"wt/engine/{engine_rank}/connected"


def version_key(engine_rank: int, version: int) -> str:
    """An engine rank's result of ``update_weights`` for ``version`` (JSON), or ``err:...``."""
    return f"wt/engine/{engine_rank}/v{version}"


def error_text(e: BaseException) -> str:
    """``err:{Type}:{message}``; an exception that is not a FastSyncError travels as FastSyncError
    naming its own type."""
    if isinstance(e, FastSyncError):
        return f"err:{type(e).__name__}:{e}"
    return f"err:FastSyncError:{type(e).__name__}: {e}"


def raise_error_text(raw: bytes | str, prefix: str) -> None:
    """Raise the FastSyncError that :func:`error_text` wrote (``raw`` starts with ``err:``)."""
    from fastsync import errors

    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    cls_name, _, msg = text[4:].partition(":")
    cls = getattr(errors, cls_name, FastSyncError)
    if not (isinstance(cls, type) and issubclass(cls, FastSyncError)):
        cls = FastSyncError
    raise cls(f"{prefix}: {msg}")


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


class _WorkerView(FastSyncWorkerExtension):
    """The extension's methods on this engine's model: they read ``model_runner.model``,
    ``vllm_config`` and ``rank`` from ``self``, which is all a worker gives them."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, rank: int) -> None:
        self.model_runner = SimpleNamespace(model=model)
        self.vllm_config = vllm_config
        self.rank = rank


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
        # one view for the engine's life: describing again keeps the served version, the staging
        # arena and the snapshot memory (the extension's state lives on it)
        self._view = _WorkerView(model, vllm_config, 0)
        self._connected = False
        self._control: TCPStoreControl | None = None
        self._rank = 0
        self._flipped: int | None = None  # the version this update session flipped to

    # ---- init -----------------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> FastSyncWeightTransferInitInfo:
        if not isinstance(init_dict, dict):
            raise ValueError(f"Invalid init_info for {type(self).__name__}: expected a dict, got {type(init_dict).__name__}")
        return super().parse_init_info(init_dict)

    def init_transfer_engine(self, init_info: FastSyncWeightTransferInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = init_info.rank_offset + self._dp_index * self._world + get_tensor_model_parallel_rank()
        # the job secret comes from this process's environment, never from the request
        control = TCPStoreControl.client(init_info.control_port, host=init_info.control_host,
                                         prefix=init_info.control_prefix)
        view = self._view
        view.model_runner.model, view.rank = self.model, get_tensor_model_parallel_rank()
        pending = describe_key(rank)
        try:
            desc = view._fastsync_describe({"rank_offset": init_info.rank_offset + self._dp_index * self._world})
            st = view._fastsync_state()
            rx = st.receiver
            desc.update(num_ranks=self._world * int(getattr(self.parallel_config, "data_parallel_size", 1) or 1),
                        version=st.version, attempted=max(st.version, rx.versions.attempted if rx is not None else 0))
            control.set(pending, json.dumps(desc))
            pending = connected_key(rank)
            raw = control.get(connect_key(), init_info.timeout_s, what="trainer rank 0 (plan)")
            if raw.startswith(b"err:"):
                raise_error_text(raw, f"engine rank {rank}: the trainers refused the set-up")
            got = json.loads(raw)
            result = view._fastsync_connect(got["plan"], got["options"])
            control.set(pending, json.dumps(result))
        except BaseException as e:
            try:
                control.set(pending, error_text(e))  # the trainer reports this, not a timeout
            except Exception:
                pass
            control.close()
            # a set-up refused before connecting leaves the previous one (if any) working: its
            # receiver is replaced only by a successful connect
            if pending == connected_key(rank) and view._fastsync_state().receiver is None:
                self._connected = False
            raise
        if self._control is not None:  # the previous trainer set-up's store
            self._control.close()
        self._control, self._rank, self._connected = control, rank, True
        log.info("fastsync weight transfer: engine rank %d connected (%s)", rank, result)

    # ---- one update -----------------------------------------------------------------------
    def _state(self, what: str) -> Any:
        if not self._connected:
            raise SyncError(f"fastsync weight transfer: {what} before init_weight_transfer_engine connected this "
                            "worker to the trainers")
        return self._view._fastsync_state(connected=True)

    def start_weight_update(self) -> None:
        st = self._state("start_weight_update")
        if st.open is not None:
            raise SyncError(f"engine rank {st.rank}: version {st.open} is still open")
        st.receiver.prepare()  # the in-place snapshot, taken while nothing is being written
        self._flipped = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse and receive; no ``torch.accelerator.synchronize()`` (the base class's): vLLM-CPU
        has no accelerator (it raises there), and the receiver returns only after every write
        landed and the flip is done."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FastSyncWeightTransferUpdateInfo) -> None:
        st = self._state("update_weights")
        assert self._control is not None
        version = update_info.version
        key = version_key(self._rank, version)
        try:
            if self._flipped is not None:
                raise SyncError(f"engine rank {st.rank}: this update session already flipped to version "
                                f"{self._flipped}; version {version} needs a new start_weight_update")
            t0 = time.perf_counter()
            got = self._view._fastsync_begin(version)
            got = self._view._fastsync_finish(version, float(update_info.timeout_s))
            got = {k: v for k, v in got.items() if k != "sync"}
            got["update_s"] = time.perf_counter() - t0
        except BaseException as e:
            try:
                self._control.set(key, error_text(e), timeout_s=2.0)
            except Exception:
                pass
            raise
        self._flipped = version
        try:
            self._control.set(key, json.dumps(got), timeout_s=2.0)
        except Exception as e:  # serving the new version; the trainer's HTTP call still succeeds
            log.warning("engine rank %d: version %d flipped, result not published: %s", st.rank, version, e)

    def finish_weight_update(self) -> None:
        st = self._state("finish_weight_update")
        if st.open is not None:  # a begin without its finish (cannot happen through update_weights)
            raise SyncError(f"engine rank {st.rank}: finish_weight_update while version {st.open} is open")
        self._flipped = None

    # ---- teardown -------------------------------------------------------------------------
    def _close(self) -> None:
        self._view.fastsync_close()
        if self._control is not None:
            self._control.close()
        self._control, self._connected = None, False

    def shutdown(self) -> None:
        self._close()

    def served_version(self) -> int:
        """The fastsync version this worker serves (0: the checkpoint it loaded)."""
        return self._view.fastsync_version()
