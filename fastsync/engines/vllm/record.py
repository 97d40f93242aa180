"""Record a live vLLM model's engine layout by running its own weight loaders on recording tensors.

vLLM's ``sharded_rdt`` weight-transfer backend (``vllm/distributed/weight_transfer/
sharded_rdt_fake.py``) showed the way: feed ``model.load_weights`` zero-storage tensors and
capture every ``narrow`` / ``chunk`` / ``view`` / ``copy_`` the loaders perform. Whatever vLLM
can load, this can map, including fused tensors (``qkv_proj``, ``gate_up_proj``, MoE
``w13_weight``), TP slices, padded vocabularies and tied weights.

How, in order (:func:`record_copies`):

1. Every parameter of the model is swapped, for the duration of the recording only, for a *twin*
   on the meta device in loader format: vLLM keeps each layer's pre-``process_weights_after_
   loading`` parameters as meta tensors (``record_metadata_for_reloading`` at model creation,
   ``LAYERWISE_INFO``), so a CPU linear whose weight was prepacked and emptied is recorded at
   its real shape. Parameters vLLM keeps no metadata for (biases) get a meta twin of the live
   one. Live memory is never written; the originals are put back in a ``finally``.
2. For each checkpoint tensor (names and shapes only, no bytes), ``model.load_weights`` is called
   with one :class:`RecordingTensor`. Each tensor carries a meta *view* of a meta tensor of the
   checkpoint shape, so after any chain of view ops its ``storage_offset`` and strides say
   exactly which elements of the checkpoint tensor it holds.
3. ``copy_`` (and ``dst[idx] = src``) into a twin records a :class:`Copy`: the destination box
   in the engine parameter's (rank-local) coordinates and the source box in the checkpoint
   tensor. Both views must be boxes in row-major order (then ``dst_box <- src_box`` element
   for element is a fastsync ``Segment``).
4. Anything that is not a copy of a box is refused, naming the checkpoint tensor and the
   operation: arithmetic, ``item()``, a transpose or permute that reorders elements, a
   reinterpreting ``view(dtype)``, advanced indexing, a broadcasting copy. A cast between
   floating dtypes is allowed (fastsync casts to the engine's dtype anyway). A refused tensor
   falls back to vLLM's own ``load_weights`` at each flip (``fallback.py``).

``fastsync.engines.vllm.recorded_map`` turns a :class:`Recording` into a ``NameMap``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fastsync.errors import LayoutError
from fastsync.layout.box import Box

__all__ = ["Copy", "Recording", "RecordingTensor", "RecordRefused", "record_copies", "meta_twins", "storage_id"]


class RecordRefused(LayoutError):
    """A weight loader did something to a recording tensor that is not a copy of a box.
    ``tensor``: the checkpoint tensor's name (parsed from the message)."""

    @property
    def tensor(self) -> str | None:
        msg = str(self)
        if msg.startswith("checkpoint tensor '"):
            return msg[len("checkpoint tensor '"):].split("'", 1)[0]
        return None


@dataclass(frozen=True, slots=True)
class Copy:
    """``engine_param[dst_box] = checkpoint[src][src_box]`` (local engine coordinates)."""

    dst: str
    dst_box: Box
    src: str
    src_box: Box
    ops: tuple[str, ...] = ()


@dataclass(slots=True)
class Recording:
    """What one worker's loaders did with every checkpoint tensor.

    ``copies``: engine parameter -> its recorded copies. ``params``: the checkpoint tensors fed
    (name -> shape). ``skipped``: checkpoint tensors the loaders consumed without a copy (a tied
    ``lm_head.weight``, experts of another EP rank). ``refused``: checkpoint tensor -> why it
    cannot be recorded (operation named). ``shapes``: engine parameter -> local loader-format
    shape, for every parameter of the model (written or not). ``dtypes``: the same, dtypes.
    ``split_fed``: the loader took fused expert tensors only as per-expert views (``splits``).
    """

    copies: dict[str, list[Copy]] = field(default_factory=dict)
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    split_fed: bool = False


#: dtype marker of a checkpoint tensor tied to another (``"tied:model.embed_tokens.weight"``)
TIED = "tied:"


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def view_box(view: torch.Tensor, shape: tuple[int, ...], what: str) -> Box | None:
    """The box of a contiguous tensor of ``shape`` that ``view`` (sharing its storage) holds, when
    ``view``'s elements in row-major order are exactly that box's in row-major order; else None."""
    strides, acc = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        strides[k] = acc
        acc *= shape[k]
    off = view.storage_offset()
    start = [(off // strides[k]) % shape[k] if shape[k] else 0 for k in range(len(shape))]
    if sum(s * st for s, st in zip(start, strides)) != off:
        return None
    extent = [1] * len(shape)
    last = -1
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            continue
        ks = [k for k in range(len(shape)) if strides[k] == stride and shape[k] > 1 and k > last]
        if not ks:
            return None
        k = ks[0]
        extent[k], last = size, k
    box = tuple((s, s + e) for s, e in zip(start, extent))
    if any(b > n for (_, b), n in zip(box, shape)):
        return None  # e.g. a flat run across rows: not a box
    return box


_VIEW_OPS = {"narrow", "view", "reshape", "__getitem__", "unsqueeze", "squeeze", "transpose", "t", "permute",
             "flatten", "chunk", "unbind", "split", "select", "expand", "view_as", "reshape_as", "unflatten",
             "movedim", "swapaxes", "split_with_sizes", "tensor_split", "as_strided"}
_IDENTITY = {"contiguous", "detach", "clone", "cpu", "requires_grad_", "detach_"}
_CASTS = {"to", "float", "half", "bfloat16", "double", "type_as", "type"}
_PROPS = {torch.Tensor.T.__get__: "T", torch.Tensor.mT.__get__: "mT", torch.Tensor.data.__get__: "data"}


class _Sink:
    """Where recording tensors' copies go: knows the twins by storage."""

    def __init__(self, twins: dict[int, tuple[str, torch.Tensor]]) -> None:
        self.twins = twins
        self.copies: dict[str, list[Copy]] = {}

    def accept(self, dest: torch.Tensor, src: RecordingTensor) -> None:
        hit = self.twins.get(storage_id(dest)) if dest.is_meta else None
        if hit is None:
            raise RecordRefused(f"checkpoint tensor {src._name!r}: copy_ into a tensor that is not an engine parameter "
                                f"(ops {list(src._ops)}); fastsync can only write into parameters")
        name, twin = hit
        if dest.numel() != src.numel():
            raise RecordRefused(f"checkpoint tensor {src._name!r}: broadcasting copy_ into engine parameter {name!r} "
                                f"({src.numel()} elements into {dest.numel()})")
        dbox = view_box(dest, tuple(twin.shape), f"engine parameter {name!r}")
        if dbox is None:
            raise RecordRefused(f"checkpoint tensor {src._name!r}: the loader writes a strided, non-box region of "
                                f"engine parameter {name!r} (shape {tuple(dest.shape)}, stride {dest.stride()})")
        sbox = view_box(src._view, tuple(src._root_shape), f"checkpoint tensor {src._name!r}")
        if sbox is None:
            reorder = [o for o in src._ops if o in ("t", "T", "mT", "transpose", "permute", "movedim", "swapaxes")]
            raise RecordRefused(f"checkpoint tensor {src._name!r}: operation {reorder[0] if reorder else src._ops} "
                                f"reorders its elements before the copy into engine parameter {name!r} "
                                f"(ops {list(src._ops)}); not a copy of a box")
        self.copies.setdefault(name, []).append(Copy(name, dbox, src._name, sbox, tuple(src._ops)))


class RecordingTensor(torch.Tensor):
    """Zero-storage stand-in for one checkpoint tensor; records how loaders slice and copy it.

    ``_view`` is a meta view of a meta tensor of the checkpoint's shape (``_root_shape``); every
    allowed view op is applied to it, so its geometry always says which elements this holds."""

    _name: str
    _view: torch.Tensor
    _root_shape: tuple[int, ...]
    _ops: tuple[str, ...]
    _sink: _Sink

    @staticmethod
    def __new__(cls, name: str, view: torch.Tensor, root_shape: tuple[int, ...], dtype: torch.dtype,
                ops: tuple[str, ...], sink: _Sink) -> RecordingTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, view.shape, strides=view.stride(), dtype=dtype,
                                                device=torch.device("cpu"), requires_grad=False)
        t._name, t._view, t._root_shape, t._ops, t._sink = name, view, root_shape, ops, sink
        return t

    @classmethod
    def root(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype, sink: _Sink) -> RecordingTensor:
        return cls(name, torch.empty(shape, dtype=dtype, device="meta"), tuple(shape), dtype, (), sink)

    def _child(self, view: torch.Tensor, op: str, dtype: torch.dtype | None = None) -> RecordingTensor:
        if storage_id(view) != storage_id(self._view):
            raise RecordRefused(f"checkpoint tensor {self._name!r}: operation {op!r} does not return a view "
                                f"(ops {list(self._ops) + [op]}); not a copy of a box")
        return RecordingTensor(self._name, view, self._root_shape, dtype or self.dtype, self._ops + (op,), self._sink)

    def __repr__(self) -> str:  # never print data (there is none)
        return f"RecordingTensor({self._name!r}, shape={tuple(self.shape)}, ops={list(self._ops)})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(src, cls):
                src._sink.accept(args[0], src)
                return args[0]
            raise RecordRefused(f"checkpoint tensor {args[0]._name!r}: a loader writes into it (copy_)")
        if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], cls) and not isinstance(args[0], cls):
            with torch._C.DisableTorchFunctionSubclass():
                dest = args[0][args[1]]
            args[2]._sink.accept(dest, args[2])
            return None
        self_ = args[0] if args else None
        if isinstance(self_, cls):
            if func in _PROPS:
                op = _PROPS[func]
                return self_ if op == "data" else self_._child(getattr(self_._view, op), op)
            name = getattr(func, "__name__", "")
            if name in _VIEW_OPS:
                meta_args = tuple(a._view if isinstance(a, cls) else a for a in args[1:])
                with torch._C.DisableTorchFunctionSubclass():
                    res = getattr(self_._view, name)(*meta_args, **kwargs)
                if isinstance(res, torch.Tensor):
                    return self_._child(res, name)
                return tuple(self_._child(r, name) for r in res)
            if name in _IDENTITY:
                return self_
            if name in _CASTS:
                return self_._cast(name, args[1:], kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _cast(self, name: str, args: tuple, kwargs: dict) -> RecordingTensor:
        dtype = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                 "double": torch.float64}.get(name)
        if name == "type_as":
            dtype = args[0].dtype
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, torch.Tensor) and name == "to":
                dtype = a.dtype
        if dtype is None or dtype == self.dtype:
            return self
        if not (dtype.is_floating_point and self.dtype.is_floating_point):
            raise RecordRefused(f"checkpoint tensor {self._name!r}: cast {self.dtype} -> {dtype} ({name}) changes "
                                f"values (ops {list(self._ops)}); only floating-point casts are recorded")
        return RecordingTensor(self._name, self._view, self._root_shape, dtype, self._ops + (f"{name}({dtype})",),
                               self._sink)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, cls):
                raise RecordRefused(f"checkpoint tensor {a._name!r}: the loader applies {func} to it "
                                    f"(after ops {list(a._ops)}); not a copy of a box (arithmetic, item(), a "
                                    "value-changing cast or indexing by a tensor)")
        return func(*args, **(kwargs or {}))


def meta_twins(model: torch.nn.Module) -> tuple[dict[int, tuple[str, torch.Tensor]], list[tuple[torch.nn.Module, dict]],
                                             dict[str, torch.Tensor]]:
    """Meta twins (loader format) for every parameter; returns the storage index, what to put back,
    and engine name -> twin."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError as e:  # pragma: no cover - only inside vLLM workers
        raise LayoutError(f"recording a vLLM layout needs vLLM's reload metadata ({e})") from e
    live_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    by_live: dict[int, torch.Tensor] = {}
    index: dict[int, tuple[str, torch.Tensor]] = {}
    saved: list[tuple[torch.nn.Module, dict]] = []
    by_name: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules(remove_duplicate=True):
        info = LAYERWISE_INFO.get(module)
        meta_params = info.restore_metadata[0] if info is not None else {}
        live = {n: p for n, p in module._parameters.items() if p is not None}
        if not live and not meta_params:
            continue
        saved.append((module, dict(module._parameters)))
        for attr in list(live) + [a for a in meta_params if a not in live]:
            p = live.get(attr)
            if p is not None and id(p) in by_live:  # a tied parameter: one twin for both modules
                module._parameters[attr] = by_live[id(p)]  # type: ignore[assignment]
                continue
            base = meta_params.get(attr, p)
            twin = restore_layer_refs(to_meta_tensor(base), module)
            if not twin.is_meta:
                twin = to_meta_tensor(twin)
            name = live_names.get(id(p), f"{path}.{attr}" if path else attr) if p is not None else (
                f"{path}.{attr}" if path else attr)
            if p is not None:
                by_live[id(p)] = twin
            index[storage_id(twin)] = (name, twin)
            by_name[name] = twin
            module._parameters[attr] = twin  # type: ignore[assignment]
    return index, saved, by_name


def record_copies(model: torch.nn.Module, params: dict[str, tuple[tuple[int, ...], str]],
                  max_attempts: int | None = None, names: dict[str, str] | None = None,
                  splits: dict[str, list[tuple[str, tuple[int, slice]]]] | None = None) -> Recording:
    """Run ``model.load_weights`` over recording tensors for every checkpoint tensor in ``params``
    (name -> (shape, dtype name)) and return what every loader copied where.

    One ``load_weights`` call takes all tensors (models check across tensors at the end, e.g. a
    tied ``lm_head`` needs the embedding in the same call). A tensor whose loader is refused (or
    raises) is recorded in ``refused`` and the call is repeated without it. Never writes live
    memory; the model's parameters are put back even when a loader raises. ``names``: the name
    to hand vLLM's loader for each checkpoint tensor (default: its own); copies keep the key of
    ``params``. ``splits``: per-expert pieces of fused expert tensors (``record_names.
    expert_splits``), fed instead of the fused tensor once the loader has refused a fused name
    (a loader that knows only the per-expert checkpoint)."""
    names, splits = names or {}, splits or {}
    use_splits = False
    rec = Recording(params={n: tuple(s) for n, (s, _) in params.items()})
    index, saved, by_name = meta_twins(model)
    attempts = max_attempts if max_attempts is not None else len(params) + 1
    try:
        for _ in range(attempts):
            sink = _Sink(index)
            current: list[str] = []

            def feed() -> Any:
                for name, (shape, dtype) in params.items():
                    if name in rec.refused or dtype.startswith(TIED):
                        continue
                    current[:] = [name]
                    root = RecordingTensor.root(name, tuple(shape), getattr(torch, dtype), sink)
                    if use_splits and name in splits:
                        for piece, (e, rows) in splits[name]:
                            yield piece, root[e, rows]
                    else:
                        yield names.get(name, name), root
                current.clear()

            try:
                with torch.no_grad():
                    got = model.load_weights(feed())
                    if got is not None and not isinstance(got, (set, list, tuple, dict)):
                        list(got)  # a generator-style loader
            except RecordRefused as e:
                rec.refused[e.tensor or (current[0] if current else "?")] = str(e)
                continue
            except Exception as e:  # the model's load_weights cannot take this name/shape at all
                name = current[0] if current else "?"
                if name in splits and not use_splits:  # a per-expert loader: feed the experts one by one
                    use_splits = True
                    continue
                rec.refused[name] = f"checkpoint tensor {name!r}: vLLM's load_weights raised {type(e).__name__}: {e}"
                if not current:
                    break
                continue
            rec.copies = sink.copies
            break
        written = {c.src for cs in rec.copies.values() for c in cs}
        rec.skipped = set(params) - written - set(rec.refused)
        rec.split_fed = use_splits
        rec.shapes = {n: tuple(t.shape) for n, t in by_name.items()}
        rec.dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in by_name.items()}
    finally:
        for module, original in saved:
            module._parameters.clear()
            module._parameters.update(original)
    return rec
