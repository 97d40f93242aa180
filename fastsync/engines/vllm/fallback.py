"""Checkpoint tensors vLLM's loaders transform: loaded through vLLM's own ``load_weights`` at each flip.

The recorder (``record.py``) refuses a loader that does something other than copy a box of a
checkpoint tensor (GPT-2's ``Conv1D`` weights are transposed, ``loaded_weight.t()``; a loader may
scale, permute or index). Such a tensor *falls back*: set-up names it and the operation, and on
every sync it reaches each engine rank whole and goes through ``model.load_weights([(name,
tensor)])`` inside the same fence as the fast path. In order:

1. Set-up (:func:`plan_fallback`, in the worker): which engine parameters each refused tensor's
   loader writes is found by running ``load_weights`` on meta tensors against the model's meta
   twins under a dispatch mode that sees every in-place write (:func:`probe_writes`; no live
   memory is touched). The closure follows: a recordable tensor that fills a parameter a
   fallback tensor also writes (``q_proj`` beside a refused ``k_proj`` in ``qkv_proj``) falls
   back too, so every engine parameter is filled either entirely by the recorded fast path or
   entirely by vLLM's loader, never half by each.
2. The plan: each fallback tensor is one more engine tensor on every rank, a buffer named
   :data:`BUFFER` + the checkpoint name, of the checkpoint's full shape in the engine's dtype,
   with one piece ``buffer[:] = trainer[name][:]``. The planner, the transports, verification,
   deltas and replicas move it as any other tensor: each trainer rank writes its own shard of
   it, nothing is gathered.
3. The flip (:meth:`Fallback.load`, before the CPU repack): the in-place parameters it writes are
   snapshotted (the undo list the extension already keeps for a failed flip), the model's
   parameters are swapped for loader-format tensors (meta everywhere but the parameters the
   fallback writes, which point at their live memory or at their staging tensor for a prepacked
   linear), ``model.load_weights`` runs on the buffers, the originals are put back. Then the
   extension's post-processing repacks as after any sync; a failure anywhere restores the
   snapshots and the engine keeps serving its last complete version.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fastsync.errors import LayoutError, SyncError
from fastsync.engines.vllm.layout import STAGED_KINDS
from fastsync.executor.arena import carve_typed
from fastsync.layout.box import full_box
from fastsync.layout.types import EngineTensor, Piece

__all__ = ["BUFFER", "Fallback", "plan_fallback", "probe_writes"]

log = logging.getLogger(__name__)

#: Engine-tensor name prefix of a fallback buffer (``fastsync.fallback:transformer.h.0.attn.c_attn.weight``)
BUFFER = "fastsync.fallback:"


def _feed(name: str, t: torch.Tensor, names: dict[str, str], splits: dict | None) -> list[tuple[str, torch.Tensor]]:
    """What ``load_weights`` is handed for checkpoint tensor ``name``: its loader name, or its
    per-expert views where the recording fed the loader per expert (``record_names.expert_splits``)."""
    if splits and name in splits:
        return [(piece, t[e, rows]) for piece, (e, rows) in splits[name]]
    return [(names.get(name, name), t)]


def _run_loader(model: torch.nn.Module, items: Any) -> None:
    got = model.load_weights(items)
    if got is not None and not isinstance(got, (set, list, tuple, dict)):
        list(got)  # a generator-style loader


def probe_writes(model: torch.nn.Module, tensors: dict[str, tuple[tuple[int, ...], str]], names: dict[str, str],
                 splits: dict | None = None) -> dict[str, set[str]]:
    """Checkpoint tensor -> the engine parameters vLLM's ``load_weights`` writes for it, found on
    meta twins (no live memory touched): every op whose schema marks an argument as written is
    matched, by storage, against the twins."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastsync.engines.vllm.record import storage_id, meta_twins

    index, saved, _ = meta_twins(model)
    writes: dict[str, set[str]] = {n: set() for n in tensors}
    current: list[str] = []

    class _Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if current:
                for i, a in enumerate(func._schema.arguments):
                    if a.alias_info is None or not a.alias_info.is_write:
                        continue
                    t = args[i] if i < len(args) else kwargs.get(a.name)
                    hit = index.get(storage_id(t)) if isinstance(t, torch.Tensor) and t.is_meta else None
                    if hit is not None:
                        writes[current[0]].add(hit[0])
            return func(*args, **kwargs)

    def feed() -> Any:
        for name, (shape, dtype) in tensors.items():
            current[:] = [name]
            yield from _feed(name, torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta"), names, splits)
        current.clear()

    try:
        with torch.no_grad(), _Writes():
            _run_loader(model, feed())
    except Exception as e:
        who = current[0] if current else sorted(tensors)[0]
        raise LayoutError(f"checkpoint tensor {who!r} falls back to vLLM's load_weights, but running its loader on a "
                          f"meta tensor failed ({type(e).__name__}: {e}), so fastsync cannot tell which engine "
                          "parameters it writes; use a hand-written name map (fastsync_name_map hook)") from e
    finally:
        for module, original in saved:
            module._parameters.clear()
            module._parameters.update(original)
    return writes


def plan_fallback(rec: Any, params: dict[str, tuple[tuple[int, ...], str]],
                  probe: Any) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """(checkpoint tensor -> why it falls back, engine parameter -> the checkpoint tensors that
    fill it) for a recording with refused tensors. ``params``: the checkpoint tensors (shape,
    dtype) the recording was fed; ``probe(tensors)`` is :func:`probe_writes` bound to the model.
    Closes over shared parameters (see the module docstring)."""
    why = dict(rec.refused)
    writes: dict[str, set[str]] = {}
    pending = set(why)
    while pending:
        writes.update(probe({n: params[n] for n in sorted(pending)}))
        pending = set()
        for x in sorted(writes):
            for p in sorted(writes[x]):
                for c in rec.copies.get(p, []):
                    if c.src not in why:
                        why[c.src] = (f"checkpoint tensor {c.src!r}: a copy of a box, but it fills engine parameter "
                                      f"{p!r} beside {x!r}, which falls back; loaded with it")
                        pending.add(c.src)
    loads: dict[str, list[str]] = {}
    for x, ps in writes.items():
        for p in ps:
            loads.setdefault(p, []).append(x)
    return why, {p: tuple(sorted(xs)) for p, xs in sorted(loads.items())}


@dataclass(slots=True)
class Fallback:
    """One worker's fallback: what falls back and why, which engine parameters vLLM's loader
    fills from it, and the buffers the trainer ranks write (allocated at connect, kept across
    connects of the same layout)."""

    why: dict[str, str]
    loads: dict[str, tuple[str, ...]]
    shapes: dict[str, tuple[int, ...]]
    dtype: str
    names: dict[str, str] = field(default_factory=dict)
    splits: dict = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    snapshots: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, recorded: Any, dtype: str, rank: int) -> Fallback | None:
        """The fallback of a recorded layout (``recorded_map.RecordedMap``; None when nothing falls
        back), each tensor named with its operation in a warning: set-up says it falls back."""
        if recorded is None or not recorded.fallback:
            return None
        fb = cls(dict(recorded.fallback), dict(recorded.loads),
                 {x: tuple(recorded.params[x]) for x in recorded.fallback}, dtype,
                 names=dict(recorded.names), splits=dict(recorded.splits))
        for d in fb.describe().values():
            log.warning("fastsync: engine rank %d: %s; it falls back to vLLM's own load_weights at each flip, "
                        "filling engine parameter(s) %s", rank, d["why"], d["loads"])
        return fb

    def engine_tensors(self) -> dict[str, EngineTensor]:
        """One buffer per fallback tensor, filled whole from the trainer's tensor."""
        return {BUFFER + x: EngineTensor(BUFFER + x, tuple(s), self.dtype, (Piece(full_box(s), x, full_box(s)),))
                for x, s in sorted(self.shapes.items())}

    def describe(self) -> dict:
        """For ``fastsync_describe``: each fallback tensor, the operation, the parameters it loads."""
        return {x: {"why": w, "loads": sorted(p for p, xs in self.loads.items() if x in xs),
                    "path": "vLLM's load_weights at each flip (falls back)"} for x, w in sorted(self.why.items())}

    def volume(self) -> dict:
        """How much goes the fallback way at each flip: tensors and bytes (every sync result carries it)."""
        item = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return {"tensors": len(self.shapes), "bytes": sum(math.prod(s) for s in self.shapes.values()) * item,
                "names": sorted(self.shapes)[:8]}

    def adopt(self, old: Fallback | None) -> None:
        """Keep the previous describe's buffers (a live receiver may still point at them)."""
        if old is not None and old.shapes == self.shapes and old.dtype == self.dtype:
            self.buffers, self.snapshots = old.buffers, old.snapshots

    def allocate(self, live: dict) -> None:
        """The buffers (one touched arena, one registration) and the snapshots of the in-place
        parameters the loader writes, once."""
        if self.buffers:
            return
        dt = getattr(torch, self.dtype)
        _, views = carve_typed(None, [(BUFFER + x, s, dt) for x, s in sorted(self.shapes.items())])
        self.buffers.update(views)
        for p in self.loads:
            if live[p].kind not in STAGED_KINDS:
                self.snapshots[p] = torch.zeros_like(live[p].live)

    def load(self, model: torch.nn.Module, live: dict, staging: dict, undo: list) -> None:
        """Run vLLM's ``load_weights`` on the buffers into the parameters they fill (staging for
        prepacked linears); snapshot in-place ones first and push their restore onto ``undo``.
        Raises SyncError naming the tensor when the loader fails (the caller rolls back)."""
        from fastsync.engines.vllm.record import meta_twins

        for p, snap in self.snapshots.items():
            snap.copy_(live[p].live)
            undo.append(_Snapshot(live[p].live, snap))
        # the memory each parameter is loaded into, read before the twins replace the parameters
        dests = {p: staging[p] if live[p].kind in STAGED_KINDS else live[p].live for p in self.loads}
        index, saved, by_name = meta_twins(model)
        current: list[str] = []
        try:
            real: dict[int, torch.Tensor] = {}
            for p, dst in dests.items():
                twin = by_name.get(p)
                if twin is None or dst.numel() != twin.numel():
                    raise SyncError(f"engine parameter {p!r}: vLLM's loader format {None if twin is None else tuple(twin.shape)} "
                                    f"does not fit its memory {tuple(dst.shape)}; cannot load it through load_weights")
                t = dst.view(twin.shape)
                t.__class__ = twin.__class__
                t.__dict__ = twin.__dict__.copy()
                real[id(twin)] = t
            for module, _ in saved:
                for attr, q in list(module._parameters.items()):
                    if q is not None and id(q) in real:
                        module._parameters[attr] = real[id(q)]  # type: ignore[assignment]

            def feed() -> Any:
                for x in sorted(self.shapes):
                    current[:] = [x]
                    yield from _feed(x, self.buffers[BUFFER + x].clone(), self.names, self.splits)
                current.clear()

            with torch.no_grad():
                _run_loader(model, feed())
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"checkpoint tensor {current[0] if current else '?'!r}: vLLM's load_weights failed on the "
                            f"fallback path ({type(e).__name__}: {e})") from e
        finally:
            for module, original in saved:
                module._parameters.clear()
                module._parameters.update(original)


class _Snapshot:
    """An in-place parameter's bytes before the fallback loader wrote it (``restore`` puts them back)."""

    def __init__(self, live: torch.Tensor, snap: torch.Tensor) -> None:
        self.live, self.snap = live, snap

    def restore(self) -> None:
        self.live.copy_(self.snap)
