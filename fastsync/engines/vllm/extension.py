"""vLLM worker extension: trainer ranks write new weights straight into a live vLLM engine.

Pass ``worker_extension_cls="fastsync.engines.vllm.FastSyncWorkerExtension"`` to ``vllm.LLM``
(or ``--worker-extension-cls``); every vLLM worker then answers these ``collective_rpc`` calls,
in this order:

1. ``fastsync_describe(options)`` once: read the live model, build this rank's engine tensors from
   the name map (fused ``qkv_proj``, ``gate_up_proj``, MoE ``w13_weight``/``w2_weight``, TP
   slices, replicated norms), check names, local shapes and dtypes against the live parameters
   (``LayoutError`` naming the parameter otherwise) and return them for the planner.
2. ``fastsync_connect(plan_json, options)`` once: build a :class:`WeightReceiver` over the live
   memory, register it with the transport (NIXL by default) and publish its addresses.
3. Per sync: ``fastsync_begin(version)`` then ``fastsync_finish(version, timeout_s)`` (or both in
   ``fastsync_update``). ``finish`` drives the transport until every planned write of the version
   landed (NIXL's UCX progress happens in these polls: without them a one-sided write never
   completes), then runs the post-processing the CPU kernels need, then flips the version.
4. ``fastsync_version()`` any time: the weight version the worker serves (0 = the checkpoint).

Where the bytes land (see ``fastsync.engines.vllm.layout`` for how each kind is detected):
``inplace`` parameters (embedding, norms) are written in their live memory and snapshotted at
``begin`` so a failed sync restores them; prepacked CPU weights (linear layers, fused MoE
experts) cannot be written in place, because the kernels read a packed copy: each gets one
staging tensor (registered once), and at the flip the layer's own post-load step is re-run from
it (``quant_method.process_weights_after_loading`` for linears, ``prepack_moe_weight`` into the
live expert tensors). Those parameters are listed at ``fastsync_describe``, with the reason.

Fence: a ``collective_rpc`` runs inside the engine-core loop, so no forward pass runs while
``fastsync_finish`` (or ``fastsync_update``) is in progress; between ``fastsync_begin`` and
``fastsync_finish`` the host must not schedule generation (``VllmEngine`` in
``fastsync.engines.vllm.handle`` keeps both inside one call). Atomicity: a sync that does not
complete (a trainer died, a transfer is missing, the deadline passed) is rolled back: in-place
parameters are restored from their snapshot, prepacked ones were never touched, and the worker
keeps serving the last complete version.

A failed post-processing step (a layer's repack raising) is part of the same rollback: every
layer repacked so far gets its previous packed weights back and the flip is never published.

Each verb is a few lines over this worker's :class:`~fastsync.sync.engine_session.EngineSession`
(the session logic, for any engine) bound to its :class:`~fastsync.engines.vllm.binding.VllmBinding`
(where writes land, the repack at the flip); ``describe.py`` builds what the binding binds.

Errors cross ``collective_rpc`` as ``{"error": [class name, message]}`` results (vLLM would
otherwise turn a worker exception into a dead engine; an exception that is not a FastSyncError
comes back as SyncError naming its type); ``vllm_host`` re-raises them.
"""

from __future__ import annotations

import ctypes
import platform

import torch

from fastsync.engines.vllm.binding import VllmBinding
from fastsync.engines.vllm.describe import LAYOUT_ENV, LAYOUT_MODES, describe_worker, record_layout  # noqa: F401
from fastsync.engines.vllm.lora import LoraWorkerMixin
from fastsync.engines.vllm.reload import ReloadWorkerMixin
from fastsync.engines.vllm.rpc_result import call_result as _result
from fastsync.errors import SyncError
from fastsync.sync.engine_session import EngineSession

__all__ = ["FastSyncWorkerExtension", "ensure_amx_permission", "EXTENSION"]

#: The value to pass as ``worker_extension_cls``.
EXTENSION = "fastsync.engines.vllm.FastSyncWorkerExtension"


_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158


def ensure_amx_permission() -> bool:
    """Ask Linux for AMX tile state in this process; True when granted or not needed.

    vLLM's CPU attention and GEMM kernels use AMX on CPUs that report it, but Linux (>= 5.16)
    raises SIGILL on the first AMX instruction of a process that did not request the tile state
    with ``arch_prctl(ARCH_REQ_XCOMP_PERM)``. vLLM's workers do not ask (seen here: the worker
    died with exit code -4 at the first ``cpu_attention_with_kv_cache``), so the extension asks
    when its module is imported in the worker, before the first forward pass.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return True
    try:
        if not torch.cpu._is_amx_tile_supported():
            return True
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (AttributeError, OSError):
        return False


ensure_amx_permission()


class FastSyncWorkerExtension(ReloadWorkerMixin, LoraWorkerMixin):
    """Mixed into every vLLM worker by ``worker_extension_cls``; methods are ``collective_rpc``
    targets. All names start with ``fastsync_`` so they never clash with the worker's own."""

    # ---- set-up ---------------------------------------------------------------------------
    def fastsync_describe(self, options: dict | None = None) -> dict:
        """Check the live model against the name map for this rank; return this rank's engine
        tensors (JSON) and which parameters are staged, and why."""
        return _result(lambda: self._fastsync_describe(dict(options or {})))

    def _fastsync_describe(self, options: dict) -> dict:
        model = self.model_runner.model  # type: ignore[attr-defined]
        session: EngineSession[VllmBinding] | None = getattr(self, "_fastsync", None)
        desc, st = describe_worker(model, self.vllm_config, getattr(self, "rank", None), options,  # type: ignore[attr-defined]
                                   session.binding.state if session is not None else None)
        if session is None:
            self._fastsync = EngineSession(VllmBinding(st, model))
        else:  # describing again keeps the served version, the live receiver and the snapshot memory
            session.bind(VllmBinding(st, model))
        return desc

    def fastsync_record_layout(self) -> dict:
        """Record this worker's layout from vLLM's own loaders (no bytes move) and return the name
        map as JSON plus what was refused, for tests and tools."""
        return _result(lambda: record_layout(self.model_runner.model, self.vllm_config))  # type: ignore[attr-defined]

    def fastsync_connect(self, plan_json: str, options: dict) -> dict:
        """Build this rank's receiver for ``plan_json`` and register its memory with the transport.
        ``options``: a :class:`~fastsync.sync.connect_options.ConnectOptions` as it crossed
        (``wire()``), checked key by key before anything is built."""
        return _result(lambda: self._fastsync_session().connect(plan_json, dict(options)))

    # ---- one sync -------------------------------------------------------------------------
    def fastsync_begin(self, version: int) -> dict:
        """Open ``version``: snapshot in-place parameters, arm the transport, tell the trainers to
        write. The host must not generate until ``fastsync_finish`` returns."""
        return _result(lambda: self._fastsync_session().begin(int(version)))

    def fastsync_finish(self, version: int, timeout_s: float = 60.0) -> dict:
        """Wait (driving the transport) until ``version`` landed, post-process, flip. On failure
        roll back and report the error; the worker keeps serving its last complete version."""
        return _result(lambda: self._fastsync_session().finish(int(version), float(timeout_s)))

    # ---- staged receive: generation goes on, the pause is only the flip ---------------------
    def fastsync_stage(self, version: int, timeout_s: float = 60.0) -> dict:
        """Open ``version`` and receive it on a background thread of this worker (the writes land
        in staging and shadow memory, off the live model): returns at once, and the engine keeps
        generating on its version. Then ``fastsync_stage_ready`` until done, then ``fastsync_flip``."""
        return _result(lambda: self._fastsync_session().stage(int(version), float(timeout_s)))

    def fastsync_stage_ready(self, version: int) -> dict:
        """Whether the staged receive of ``version`` ended (all landed, or it failed/ran out of time)."""
        def run() -> dict:
            session = self._fastsync_session()
            return {"rank": session.rank, "done": session.landed(int(version))}
        return _result(run)

    def fastsync_flip(self, version: int, timeout_s: float = 10.0) -> dict:
        """Inside the pause: end the staged receive (bounded), then verify, copy the shadows in,
        post-process and flip, or roll back and keep the served version."""
        return _result(lambda: self._fastsync_session().flip(int(version), float(timeout_s)))

    def fastsync_update(self, version: int, timeout_s: float = 60.0) -> dict:
        """``fastsync_begin`` and ``fastsync_finish`` in one call (the engine stays fenced)."""
        got = self.fastsync_begin(version)
        if "error" in got:
            return got
        return self.fastsync_finish(version, timeout_s)

    def fastsync_version(self) -> int:
        """The weight version this worker serves (0 until the first complete sync)."""
        session = getattr(self, "_fastsync", None)
        return 0 if session is None else session.version

    def fastsync_reader_spin(self) -> list[float]:
        """How long each shared-memory queue reader alive in this worker spins after a message
        (``FASTSYNC_VLLM_SPIN_S``, else vLLM's 1 s): :func:`fastsync.engines.vllm.spin.reader_spins`."""
        from fastsync.engines.vllm.spin import reader_spins

        return reader_spins()

    def fastsync_worker_start(self) -> dict:
        """How this worker was started: the ``VLLM_WORKER_MULTIPROC_METHOD`` its engine core read when
        it made the worker (``fork`` with ``FASTSYNC_VLLM_WORKER_START=fork``, else vLLM-CPU's
        ``spawn``; :mod:`fastsync.engines.vllm.worker_start`), and its parent's pid."""
        import os

        return {"method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"), "parent": os.getppid(), "pid": os.getpid()}

    def fastsync_close(self) -> bool:
        session = getattr(self, "_fastsync", None)
        if session is not None:
            session.close()
        return True

    # ---- helpers --------------------------------------------------------------------------
    def _fastsync_session(self) -> EngineSession[VllmBinding]:
        """This worker's engine session (the reload verbs use it too)."""
        session = getattr(self, "_fastsync", None)
        if session is None:
            raise SyncError("fastsync worker extension: fastsync_describe() has not run on this worker")
        return session
