"""vLLM's :class:`~fastsync.sync.engine_session.EngineBinding`: what an engine session needs from
one vLLM worker, over the worker's :class:`~fastsync.engines.vllm.worker_state.WorkerState`.

* :meth:`VllmBinding.destinations`: ``inplace`` parameters (embedding, norms) land in their live
  memory (snapshotted or shadowed by the session's landing); prepacked CPU weights (linear layers,
  fused MoE experts) in one staging tensor each (one arena); checkpoint tensors vLLM's loader does
  more than copy (``fallback.py``) in their buffers.
* :meth:`VllmBinding.apply` (the flip hook): the fallback tensors through vLLM's own
  ``load_weights``, then each layer's own post-load step re-run from its staging tensor
  (``quant_method.process_weights_after_loading``, ``prepack_moe_weight``), every replaced layer
  state saved on the session's undo list first, so a failure anywhere puts every layer back.

Pause and resume: none here; a ``collective_rpc`` runs inside vLLM's engine-core loop, which is the
fence (the doors call ``begin``/``finish`` or ``flip`` inside one RPC).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fastsync.engines.vllm.layout import STAGED_KINDS
from fastsync.engines.vllm.lora_record import lora_layers_unwrapped
from fastsync.engines.vllm.reload import ensure_staging
from fastsync.engines.vllm.worker_state import ModuleState, WorkerState
from fastsync.errors import LayoutError, SyncError
from fastsync.sync.engine_session import Destinations, FlipReport, Restorable
from fastsync.trace.recorder import now_ns

__all__ = ["VllmBinding"]


class VllmBinding:
    """One vLLM worker's model as an engine session sees it (see the module doc)."""

    def __init__(self, state: WorkerState, model: Any) -> None:
        self.state = state
        self.model = model
        self.postprocess_s = 0.0
        self.postprocess_ns = 0  # when the last post-processing (repack) began, for a trace
        self.fallback_s = 0.0

    @property
    def rank(self) -> int:
        return self.state.rank

    def destinations(self) -> Destinations:
        st = self.state
        dest: dict[str, torch.Tensor] = {}
        live: list[str] = []
        ensure_staging(st)  # one touched arena for every prepacked parameter
        fb = st.fallback
        if fb is not None:
            fb.allocate(st.live)
        for name in st.expected:
            if fb is not None and name in fb.buffers:  # written whole; vLLM's loader reads it at the flip
                dest[name] = fb.buffers[name]
                continue
            lp = st.live[name]
            if lp.kind in STAGED_KINDS:
                dest[name] = st.staging[name]
            else:
                dest[name] = lp.live
                live.append(name)
        return Destinations(dest, live, sum(b.numel() * b.element_size() for b in st.staging.values()))

    def apply(self, undo: list[Restorable], served: int) -> None:
        self.postprocess_s = self.fallback_s = 0.0
        if self.state.fallback is not None:
            self.fallback_load(undo, served)
        self.postprocess(undo, served)

    def flip_report(self) -> FlipReport:
        fb = self.state.fallback
        return FlipReport(seconds={"postprocess_s": self.postprocess_s, "fallback_s": self.fallback_s},
                          # what went through vLLM's load_weights instead of straight into the live weights
                          extra={"fallback": fb.volume() if fb is not None else {"tensors": 0, "bytes": 0}},
                          spans=[("repack", self.postprocess_ns, int(self.postprocess_s * 1e9))])

    def committed(self, version: int) -> None:
        self.state.plain = True  # the staging tensors hold the served version's bytes

    def fallback_load(self, undo: list[Restorable], served: int) -> None:
        """The fallback tensors through vLLM's own ``load_weights`` (``fallback.py``), inside the
        flip and before the repack; the in-place parameters it writes are snapshotted onto
        ``undo``, so a failure here or later puts them back with the repacked layers."""
        st = self.state
        t0 = time.perf_counter()
        try:
            with lora_layers_unwrapped(self.model) as model:
                st.fallback.load(model, st.live, st.staging, undo)
        except Exception as e:
            _restore(undo)
            if isinstance(e, SyncError):
                raise SyncError(f"engine rank {st.rank}: {e}; every parameter keeps version {served}") from e
            raise SyncError(f"engine rank {st.rank}: the fallback load failed ({type(e).__name__}: {e}); every "
                            f"parameter keeps version {served}") from e
        finally:
            self.fallback_s = time.perf_counter() - t0

    def postprocess(self, undo: list[Restorable], served: int) -> None:
        """Re-run exactly the post-load steps the CPU kernels read from, on the new values.

        Runs inside ``WeightReceiver.finish`` before the flip is published. Each layer's state is
        saved (``undo``) before its step, and the new packed weights are built beside the old
        ones, so a failure at any layer puts every layer back as it was (the previous packed
        weights stay alive until the flip is final: transiently one more copy of them) and is
        reported as SyncError, which makes the receiver roll back and keep the old version."""
        st = self.state
        self.postprocess_ns = now_ns()
        t0 = time.perf_counter()
        name = ""
        try:
            for name, lp in st.live.items():
                if lp.kind == "linear_repack":
                    undo.append(ModuleState(lp.module))
                    # UnquantizedLinearMethod on CPU: dispatch_cpu_unquantized_gemm(remove_weight=True)
                    # packs a copy (sgl VNNI or a oneDNN handle) and empties the parameter again.
                    lp.module.weight = torch.nn.Parameter(st.staging[name], requires_grad=False)
                    lp.module.quant_method.process_weights_after_loading(lp.module)
                elif lp.kind == "inplace_repack":
                    for module in (lp.module, *lp.tied):  # a tied LM head keeps its own packed copy
                        undo.append(ModuleState(module))
                        module.quant_method.process_weights_after_loading(module)
                elif lp.kind == "moe_repack":
                    experts = lp.module.quant_method.moe_kernel.fused_experts
                    param = getattr(lp.module, lp.attr)
                    src = st.staging[name]
                    if tuple(src.shape) != lp.shape or tuple(param.data.shape) != lp.shape:
                        # the native packer trusts its shapes: a mismatch would write out of bounds
                        raise LayoutError(f"staging {tuple(src.shape)} / parameter {tuple(param.data.shape)} "
                                          f"differ from the engine shape {lp.shape}")
                    packed = torch.empty_like(src)
                    torch.ops._C.prepack_moe_weight(src, packed, experts.isa)
                    undo.append(ModuleState(lp.module))
                    param.data = packed  # the kernel reads the layer's parameter at each forward
        except Exception as e:
            _restore(undo)
            raise SyncError(f"engine rank {st.rank}: post-processing engine parameter {name!r} failed "
                            f"({type(e).__name__}: {e}); every layer keeps version {served}") from e
        finally:
            self.postprocess_s = time.perf_counter() - t0


def _restore(undo: list[Restorable]) -> None:
    for saved in reversed(undo):
        saved.restore()
    undo.clear()
