"""Worker side of peer reload, mixed into :class:`FastSyncWorkerExtension`.

An engine started with ``load_format="dummy"`` (reads no checkpoint) and the fastsync worker
extension can be filled by a live holder of the current version, or become one:

* ``fastsync_reload_state()``: the version this worker serves and whether it holds a *plain*
  copy of every engine tensor (the CPU kernels read prepacked copies; the plain bytes are the
  staging tensors fastsync fills, so an engine holds them once fastsync filled it: a sync, a
  reload, or ``fastsync_load_checkpoint``).
* ``fastsync_reload_send(plan_json, options)`` on a holder: a :class:`WeightSender` whose
  sources are this worker's engine tensors (see ``fastsync.reload.source``) writes the plan's
  share into the joining engine. Refused when the worker serves another version than asked
  (never mixed) or holds no plain copy.
* ``fastsync_reload_receive(plan_json, options)`` on the joining engine: connect a receiver
  over the live memory (its own control-plane namespace per attempt), wait, post-process, flip,
  then serve ``weight_version``. With ``rank_offset`` its workers are those engine ranks of a
  plan over several joining engines, where a joining engine may also relay what landed to the
  next one (``PeerReload.reload_group``).
* ``fastsync_load_checkpoint(model_dir, weight_version)``: the same engine reads the safetensors
  checkpoint with vLLM's own iterator and ``model.load_weights`` into the same buffers, then the
  same post-processing: the fallback when no holder is left, and the bench's baseline.
* ``fastsync_digest()``: a SHA-256 per engine tensor of the plain bytes (bit-identity checks).

Staged (prepacked) parameters share one arena (:func:`ensure_staging`): the whole engine's
weights register with NIXL as the arena plus the in-place tensors (embedding, norms).
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from fastsync.errors import ConfigError, SyncError
from fastsync.engines.vllm.layout import STAGED_KINDS, moe_pads
from fastsync.engines.vllm.rpc_result import call_result as _result
from fastsync.executor.arena import carve_typed
from fastsync.executor.staging import tensor_digest
from fastsync.layout.box import box_slices
from fastsync.layout.padding import logical_to_engine
from fastsync.sync.connect_options import ReloadReceiveOptions, ReloadSendOptions

__all__ = ["ReloadWorkerMixin", "ensure_staging", "plain_tensors"]



def ensure_staging(st: Any) -> None:
    """Give every prepacked parameter its staging tensor, all views of one touched arena
    (one NIXL registration instead of one per layer)."""
    loaded = st.fallback.loads if getattr(st, "fallback", None) is not None else {}
    need = [(n, lp) for n, lp in st.live.items()
            if lp.kind in STAGED_KINDS and (n in st.expected or n in loaded) and n not in st.staging]
    if not need:
        return
    arena, views = carve_typed(None, [(name, lp.shape, lp.live.dtype) for name, lp in need])
    st.staging.update(views)
    st.arenas = getattr(st, "arenas", []) + [arena]


def plain_tensors(st: Any) -> dict[str, torch.Tensor]:
    """Every engine parameter's plain (unpacked) bytes: staging for prepacked parameters, the live
    parameter otherwise; those vLLM's own loader fills on the fallback path included."""
    loaded = list(st.fallback.loads) if getattr(st, "fallback", None) is not None else []
    return {n: (st.staging[n] if st.live[n].kind in STAGED_KINDS else st.live[n].live)
            for n in [*st.expected, *loaded] if n in st.live}


def _refuse_fallback(st: Any, what: str) -> None:
    if getattr(st, "fallback", None) is not None:
        raise ConfigError(f"engine rank {st.rank}: {what} does not carry the {len(st.fallback.why)} checkpoint "
                          f"tensor(s) this model loads through vLLM's load_weights (fallback path, e.g. "
                          f"{sorted(st.fallback.why)[0]!r}) yet; sync it from the trainer instead")


class ReloadWorkerMixin:
    """``collective_rpc`` targets of peer reload (see the module docstring)."""

    def fastsync_reload_state(self) -> dict:

        def run() -> dict:
            session = self._fastsync_session()  # type: ignore[attr-defined]
            st = session.binding.state
            return {"rank": st.rank, "version": session.version, "plain": bool(getattr(st, "plain", False))}

        return _result(run)

    def _fastsync_reload_start(self, parse: Callable[[dict], Any], options: dict) -> tuple[Any, Any, Any, int]:
        """What both ends of a peer reload start from: this worker's engine session, its worker
        state, the options as they crossed (``parse``: ``ReloadSendOptions.parse`` or
        ``ReloadReceiveOptions.parse``) and its engine rank in the reload's plan. Several engines
        in one plan (identical replicas, fed through relay chains): an engine's workers are engine
        ranks ``rank_offset + tp_rank``. Refused for a model with fallback tensors, which peer
        reload does not carry."""
        session = self._fastsync_session()  # type: ignore[attr-defined]
        st = session.binding.state
        _refuse_fallback(st, "peer reload")
        opts = parse(options)
        return session, st, opts, opts.rank_offset + st.tp_rank

    def fastsync_reload_send(self, plan_json: str, options: dict) -> dict:
        """A holder writes its shards to the joining engines (``ReloadSendOptions``, as it crossed)."""
        return _result(lambda: self._fastsync_reload_send(plan_json, dict(options)))

    def _fastsync_reload_send(self, plan_json: str, options: dict) -> dict:
        from fastsync.plan.types import Plan
        from fastsync.reload.source import local_shards
        from fastsync.sync.sender import WeightSender

        session, st, opts, rank = self._fastsync_reload_start(ReloadSendOptions.parse, options)
        want = opts.weight_version
        if session.version != want:
            raise SyncError(f"holder engine rank {st.rank} serves version {session.version}, the joining engine asked for "
                            f"{want}: refused (versions are never mixed)")
        if not getattr(st, "plain", False):
            raise SyncError(f"holder engine rank {st.rank} holds no plain copy of its prepacked weights (it was loaded "
                            "by vLLM's own loader); fill it through fastsync once (a sync, a reload or "
                            "fastsync_load_checkpoint) to make it a holder")
        plain = plain_tensors(st)
        shards, buffer_of = local_shards(st.expected, rank)
        sources = {p: plain[t] for p, t in buffer_of.items()}
        timeout = opts.timeout_s
        t0 = time.perf_counter()
        # batches in flight: a joining engine that forwards while it receives answers over a busy
        # link, so waiting for each batch before the next leaves the link idle
        topts = {"in_flight": opts.in_flight} if opts.in_flight is not None else None
        tx = WeightSender(rank=rank, plan=Plan.loads(plan_json), sources=sources, shards=shards, control=opts.control(),
                          transport="nixl", transport_options=topts, timeout_s=timeout,
                          max_chunk_bytes=opts.chunk_bytes)  # what a joining engine in a chain forwards at once
        try:
            tx.setup()
            setup_s = time.perf_counter() - t0
            m = tx.sync(opts.handshake_version, timeout_s=timeout)
            if session.version != want:  # cannot happen inside one collective_rpc; kept as the invariant
                raise SyncError(f"holder engine rank {st.rank} changed version during the reload")
            reg = getattr(tx.transport, "registration", {})
        finally:
            tx.close()
        return {"rank": rank, "setup_s": setup_s, "send_s": m.end - m.start, "registration": reg,
                "bytes": sum(m.bytes_per_link.values())}

    def fastsync_reload_receive(self, plan_json: str, options: dict) -> dict:
        """A joining engine's workers take the weights from live holders (``ReloadReceiveOptions``)."""
        return _result(lambda: self._fastsync_reload_receive(plan_json, dict(options)))

    def _fastsync_reload_receive(self, plan_json: str, options: dict) -> dict:
        session, st, opts, rank = self._fastsync_reload_start(ReloadReceiveOptions.parse, options)
        want, hv, timeout = opts.weight_version, opts.handshake_version, opts.timeout_s
        t0 = time.perf_counter()
        # an engine holding only dummy weights has nothing worth restoring: no in-place snapshot
        got = session.connect(plan_json, opts.connect(), initial_version=0, snapshot=bool(getattr(st, "plain", False)),
                              rank=rank)
        connect_s = time.perf_counter() - t0
        reg = getattr(session.receiver.transport, "registration", {})
        try:
            t_begin = time.perf_counter()
            session.begin(hv)
            begin_s = time.perf_counter() - t_begin
            fin = session.finish(hv, timeout)
        finally:
            t_close = time.perf_counter()
            session.close()  # the trainers' next setup connects again
        session.mark_served(want)
        st.plain = True
        return {"rank": rank, "version": want, "connect_s": connect_s, "registration": reg,
                "begin_s": begin_s, "close_s": time.perf_counter() - t_close,
                "wait_s": fin["wait_s"], "landed_s": fin.get("landed_s"), "postprocess_s": fin["postprocess_s"],
                "total_s": time.perf_counter() - t0,
                "staged_bytes": got["staged_bytes"], "inplace_bytes": got["inplace_bytes"]}

    def fastsync_load_checkpoint(self, model_dir: str, weight_version: int = 0) -> dict:

        return _result(lambda: self._fastsync_load_checkpoint(str(model_dir), int(weight_version)))

    def _fastsync_load_checkpoint(self, model_dir: str, weight_version: int) -> dict:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        session = self._fastsync_session()  # type: ignore[attr-defined]
        st = session.binding.state
        if not session.is_idle():
            raise SyncError(f"engine rank {st.rank}: a version is open; cannot load the checkpoint now")
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise ConfigError(f"fastsync_load_checkpoint: no *.safetensors files in {model_dir!r}")
        ensure_staging(st)
        model = self.model_runner.model  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        # point every prepacked parameter at its staging tensor so vLLM's weight loaders fill it;
        # an MoE weight the CPU kernel pads loads into its logical shape, then moves into the
        # logical sub-box of its (zero-padded) staging tensor as vLLM's _pad_moe_intermediate does
        padded: dict[str, torch.Tensor] = {}
        for name, lp in st.live.items():
            if lp.kind == "linear_repack":
                lp.module.weight = _loading_param(lp.module, st.staging[name])
            elif lp.kind == "moe_repack":
                logical = st.expected[name].logical_shape if name in st.expected else None
                if logical is not None:
                    padded[name] = torch.zeros(logical, dtype=st.staging[name].dtype)
                getattr(lp.module, lp.attr).data = padded.get(name, st.staging[name])
        model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
        for name, loaded in padded.items():
            lp, dst = st.live[name], st.staging[name]
            for lbox, ebox in logical_to_engine(tuple(loaded.shape), moe_pads(lp.attr, tuple(loaded.shape), tuple(dst.shape))):
                dst[box_slices(ebox)] = loaded[box_slices(lbox)]
            getattr(lp.module, lp.attr).data = dst  # the padded shape again, as the kernel reads it
        read_s = time.perf_counter() - t0
        session.binding.postprocess([], session.version)  # no undo: nothing to go back to
        session.mark_served(weight_version)
        st.plain = True
        return {"rank": st.rank, "read_load_s": read_s, "postprocess_s": session.binding.postprocess_s,
                "total_s": time.perf_counter() - t0, "bytes": sum(os.path.getsize(f) for f in files)}

    def fastsync_json(self, call: str) -> Any:
        """String-only entry for ``vllm serve``'s ``POST /collective_rpc`` (dev mode passes only
        strings): ``call`` is ``{"method": "fastsync_...", "args": [...]}`` as JSON; the result
        is the method's (errors as ``{"error": [cls, msg]}``, as for every fastsync call).

        With a ``"call_id"`` in ``call`` the result comes back as ``{"call_id": id, "result": r}``:
        vLLM's executor answers ``collective_rpc`` calls strictly in order from one reply queue,
        and a call it gave up on (its ``timeout`` passed) leaves its late reply in that queue, where
        the next call reads it. The id lets the host tell such a stale reply from its own."""
        import json


        body: dict = {}

        def run() -> Any:
            body.update(json.loads(call))
            method = str(body.get("method", ""))
            if not method.startswith("fastsync_") or method == "fastsync_json" or not hasattr(self, method):
                raise ConfigError(f"fastsync_json: unknown fastsync method {method!r}")
            return getattr(self, method)(*body.get("args", []))

        out = _result(run)
        return {"call_id": body["call_id"], "result": out} if "call_id" in body else out

    def fastsync_digest(self) -> dict:

        def run() -> dict:
            session = self._fastsync_session()  # type: ignore[attr-defined]
            st = session.binding.state
            if not getattr(st, "plain", False):
                raise SyncError(f"engine rank {st.rank} holds no plain copy to digest")
            out = {n: tensor_digest(t) for n, t in sorted(plain_tensors(st).items())}
            return {"rank": st.rank, "version": session.version, "tensors": out}

        return _result(run)


def _loading_param(module: Any, data: torch.Tensor) -> Any:
    """A loader-ready parameter over ``data`` for a prepacked linear layer: after packing, vLLM
    replaces the layer's weight by an empty plain Parameter that lost its loader, so rebuild the
    ``ModelWeightParameter`` its ``UnquantizedLinearMethod.create_weights`` made, with the loader
    vLLM picks for it (``weight_loader_v2`` where the quant method supports it)."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
    from vllm.model_executor.parameter import ModelWeightParameter

    qm = type(getattr(module, "quant_method", None)).__name__
    loader = getattr(module, "weight_loader_v2", None) if qm in WEIGHT_LOADER_V2_SUPPORTED else None
    if loader is None:
        loader = getattr(module, "weight_loader", None)
    if loader is None:
        raise SyncError(f"{type(module).__name__} has no vLLM weight loader; cannot load a checkpoint into it")
    return ModelWeightParameter(data=data, input_dim=1, output_dim=0, weight_loader=loader)
