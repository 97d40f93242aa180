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
   floating dtypes is allowed (fastsync casts to the engine's dtype anyway).

``fastsync.engines.vllm.recorded_map`` turns a :class:`Recording` into a ``NameMap``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from fastsync.errors import LayoutError
from fastsync.layout.box import Box

__all__ = ["Copy", "Recording", "RecordingTensor", "RecordRefused", "record_copies", "checkpoint_params",
           "hf_params", "safetensors_params"]


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
    """

    copies: dict[str, list[Copy]] = field(default_factory=dict)
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)


#: dtype marker of a checkpoint tensor tied to another (``"tied:model.embed_tokens.weight"``)
TIED = "tied:"


def _sid(t: torch.Tensor) -> int:
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
        hit = self.twins.get(_sid(dest)) if dest.is_meta else None
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
        if _sid(view) != _sid(self._view):
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


def _twins(model: torch.nn.Module) -> tuple[dict[int, tuple[str, torch.Tensor]], list[tuple[torch.nn.Module, dict]],
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
            index[_sid(twin)] = (name, twin)
            by_name[name] = twin
            module._parameters[attr] = twin  # type: ignore[assignment]
    return index, saved, by_name


def record_copies(model: torch.nn.Module, params: dict[str, tuple[tuple[int, ...], str]],
                  max_attempts: int | None = None, names: dict[str, str] | None = None) -> Recording:
    """Run ``model.load_weights`` over recording tensors for every checkpoint tensor in ``params``
    (name -> (shape, dtype name)) and return what every loader copied where.

    One ``load_weights`` call takes all tensors (models check across tensors at the end, e.g. a
    tied ``lm_head`` needs the embedding in the same call). A tensor whose loader is refused (or
    raises) is recorded in ``refused`` and the call is repeated without it. Never writes live
    memory; the model's parameters are put back even when a loader raises. ``names``: the name
    to hand vLLM's loader for each checkpoint tensor (default: its own); copies keep the key of
    ``params``."""
    names = names or {}
    rec = Recording(params={n: tuple(s) for n, (s, _) in params.items()})
    index, saved, by_name = _twins(model)
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
                    yield names.get(name, name), RecordingTensor.root(name, tuple(shape), getattr(torch, dtype), sink)
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
                rec.refused[name] = f"checkpoint tensor {name!r}: vLLM's load_weights raised {type(e).__name__}: {e}"
                if not current:
                    break
                continue
            rec.copies = sink.copies
            break
        written = {c.src for cs in rec.copies.values() for c in cs}
        rec.skipped = set(params) - written - set(rec.refused)
        rec.shapes = {n: tuple(t.shape) for n, t in by_name.items()}
        rec.dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in by_name.items()}
    finally:
        for module, original in saved:
            module._parameters.clear()
            module._parameters.update(original)
    return rec


# ---- checkpoint parameter names and shapes, without reading weights ------------------------------

def safetensors_params(model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of every tensor in ``model_dir``'s ``*.safetensors`` files, read
    from their JSON headers only (8 bytes of length, then the header)."""
    names = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not names:
        raise LayoutError(f"{model_dir!r} holds no *.safetensors file to read parameter names from")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    dtypes = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
    for fname in names:
        with open(os.path.join(model_dir, fname), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100 << 20:
                raise LayoutError(f"{fname!r}: safetensors header of {n} bytes is not plausible")
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            dt = dtypes.get(v.get("dtype"))
            if dt is None:
                raise LayoutError(f"checkpoint tensor {k!r} in {fname!r} has dtype {v.get('dtype')!r}; recording "
                                  f"handles floating-point checkpoints only ({sorted(dtypes)})")
            out[k] = (tuple(int(x) for x in v["shape"]), dt)
    return out


def hf_params(hf_config: Any) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """The trainer's names: a transformers model built from the config on the meta device (no
    memory), its ``state_dict()`` names, shapes and dtypes (transformers v5 names, e.g. fused
    ``experts.gate_up_proj``, exactly what an HF trainer holds). None when transformers cannot
    build it."""
    try:
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception:
        return None
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    seen: dict[int, str] = {}
    for n, t in model.state_dict().items():
        first = seen.setdefault(_sid(t), n)
        # a tied tensor (lm_head.weight = embed_tokens.weight): listed, never fed to the loaders
        out[n] = (tuple(t.shape), f"{TIED}{first}" if first != n else str(t.dtype).removeprefix("torch."))
    return out


def _literal(pattern: str) -> str | None:
    """A regex pattern as the literal string it matches, when it is one (escaped dots allowed)."""
    body = pattern.replace("\\.", ".")
    if any(ch in body for ch in "*+?[](){}|\\^$"):
        return None
    return body


#: per-expert checkpoint names -> vLLM's name for the same experts fused (``build_expert_params_
#: mapping(include_fused=True)``)
_VLLM_FUSED = {("w1", "w3"): "w13", ("gate_proj", "up_proj"): "gate_up_proj"}


def _fused_expert_name(t: Any) -> tuple[str, str] | None:
    """For transformers' expert-merging converter (``.experts.*.w1.weight`` + ``.experts.*.w3.weight``
    -> ``.experts.gate_up_proj``), the fused name pair (transformers', vLLM's)."""
    srcs, tgts = list(getattr(t, "source_patterns", []) or []), list(getattr(t, "target_patterns", []) or [])
    if type(t).__name__ != "WeightConverter" or len(tgts) != 1 or not srcs:
        return None
    tgt = _literal(tgts[0])
    names = []
    for sp in srcs:
        body = sp.replace("\\.", ".")
        if not (body.startswith(".experts.*.") and body.endswith(".weight")):
            return None
        names.append(body[len(".experts.*."):-len(".weight")])
    fused = _VLLM_FUSED.get(tuple(names), names[0] if len(names) == 1 else None)
    if tgt is None or not tgt.startswith(".experts.") or fused is None:
        return None
    return tgt, f".experts.{fused}"


def loader_names(hf_config: Any, names: list[str]) -> dict[str, str]:
    """trainer (transformers v5) name -> the name vLLM's loader knows: transformers' own key
    renamings for the model type (``conversion_mapping``: e.g. Mixtral's ``.block_sparse_moe.`` ->
    ``.mlp.``) applied in reverse, so vLLM sees the checkpoint's name while the recording keeps
    the trainer's. Fused-tensor conversions are left alone (vLLM loads fused experts itself)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        mapping = get_checkpoint_conversion_mapping(getattr(hf_config, "model_type", None)) or []
    except Exception:
        return {n: n for n in names}
    rev: list[tuple[str, str, bool]] = []
    for t in mapping:
        fused = _fused_expert_name(t)
        if fused is not None:
            rev.append((*fused, False))
            continue
        if type(t) is not WeightRenaming or len(t.source_patterns) != 1 or len(t.target_patterns) != 1:
            continue
        src, tgt = t.source_patterns[0], t.target_patterns[0]
        anchored = src.startswith("^")
        a, b = _literal(tgt), _literal(src.removeprefix("^"))
        if a and b is not None:
            rev.append((a, b, anchored))
    out = {}
    for n in names:
        m = n
        for a, b, anchored in rev:
            if anchored:
                m = b + m[len(a):] if m.startswith(a) else m
            else:
                m = m.replace(a, b)
        out[n] = m
    return out


def checkpoint_params(hf_config: Any, model_dir: str | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """What the trainer will send: the transformers model's names from the config, else the
    safetensors headers of ``model_dir``."""
    got = hf_params(hf_config)
    if got:
        return got
    if model_dir and os.path.isdir(model_dir):
        return safetensors_params(model_dir)
    raise LayoutError(f"cannot list the checkpoint's parameters: transformers cannot build the config and "
                      f"{model_dir!r} is not a local directory with safetensors files")
