"""Typed descriptions of where every byte of every parameter lives, on both sides of a sync.

The contract between layouts, planner and executor:

* A model is an inventory of :class:`ParamSpec` keyed by the *trainer's* parameter names (the HF
  transformers-v5 ``state_dict()`` names, e.g. ``model.layers.0.mlp.experts.gate_up_proj``).
* :class:`TrainerLayout` says which trainer rank holds which :class:`Shard` (a box of the full
  tensor) of each parameter. Replicas (HSDP, Megatron DP) are several shards with equal boxes.
* :class:`EngineLayout` says, for every engine rank, which engine tensors it holds (local
  shape and dtype, engine names such as ``...qkv_proj.weight``) and, through :class:`Piece`, which
  box of which trainer parameter fills which box of the engine tensor, by which transform.

Everything here is plain data, hashable and JSON-able: no torch, no transports.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from fastsync.errors import LayoutError
from fastsync.layout.box import Box, box_numel, box_shape, full_box, squeeze_shape

__all__ = [
    "FP8_BLOCK",
    "DTYPE_BYTES",
    "ParamSpec",
    "Shard",
    "TrainerLayout",
    "Piece",
    "EngineTensor",
    "EngineLayout",
    "fingerprint",
]

#: Bytes per element for the dtype names used in layouts (torch dtype names without "torch.").
#: Block edge of the FP8 block quantisation (DeepSeek-V3, Kimi-K2, Qwen3-FP8 checkpoints): the one
#: definition the engine layouts, the planner, the transforms and the test oracles share.
FP8_BLOCK = 128

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


def _check_dtype(dtype: str, where: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise LayoutError(f"{where}: unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")


def fingerprint(obj: object) -> str:
    """Stable short hash of a JSON-able object (layouts and plans carry one)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One trainer parameter: full (unsharded) shape and dtype, under its HF name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, f"parameter {self.name!r}")
        if any(int(n) < 0 for n in self.shape):
            raise LayoutError(f"parameter {self.name!r}: negative dim in shape {self.shape}")

    @property
    def numel(self) -> int:
        return box_numel(full_box(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Shard:
    """A trainer rank's holding of a box of one parameter.

    The rank stores ``full[box]`` contiguously (row-major, shape ``box_shape(box)``) starting at
    element ``local_offset`` of its local buffer for that parameter. FSDP2 ``Shard(d)`` and Megatron
    TP give one shard per rank with offset 0; a DeepSpeed ZeRO-3 flat partition gives a few boxes
    per rank at increasing offsets.
    """

    rank: int
    box: Box
    local_offset: int = 0


@dataclass(slots=True)
class TrainerLayout:
    """Which trainer rank holds which bytes of each parameter.

    ``kind`` is informational ("fsdp", "hsdp", "zero3", "megatron", ...). ``gather_groups`` maps a
    parameter to the ranks that would all-gather it (its FSDP/ZeRO group); the planner's owner
    gathers use it. Absent means all ranks holding shards of it.
    """

    world_size: int
    params: dict[str, ParamSpec]
    shards: dict[str, tuple[Shard, ...]]
    kind: str = "custom"
    description: str = ""

    def validate(self) -> None:
        """Every parameter covered by its shards, every shard inside its tensor and on a real rank.
        Raises LayoutError naming the parameter and rank."""
        for name, spec in self.params.items():
            shards = self.shards.get(name)
            if not shards:
                raise LayoutError(f"trainer layout ({self.kind}) holds no shard of parameter {name!r}")
            covered = 0
            seen: set[Box] = set()
            for sh in shards:
                if not 0 <= sh.rank < self.world_size:
                    raise LayoutError(f"parameter {name!r}: shard on rank {sh.rank}, world size {self.world_size}")
                if len(sh.box) != len(spec.shape) or any(
                    not (0 <= s <= e <= n) for (s, e), n in zip(sh.box, spec.shape)
                ):
                    raise LayoutError(f"parameter {name!r}: rank {sh.rank} shard {sh.box} outside shape {spec.shape}")
                if sh.box not in seen:
                    seen.add(sh.box)
                    covered += box_numel(sh.box)
            if covered < spec.numel:
                raise LayoutError(
                    f"trainer layout ({self.kind}) covers {covered} of {spec.numel} elements of parameter {name!r}"
                )
        extra = set(self.shards) - set(self.params)
        if extra:
            raise LayoutError(f"trainer layout has shards of unknown parameter(s): {sorted(extra)[:5]}")

    def shards_on(self, rank: int) -> dict[str, list[Shard]]:
        out: dict[str, list[Shard]] = {}
        for name, shards in self.shards.items():
            for sh in shards:
                if sh.rank == rank:
                    out.setdefault(name, []).append(sh)
        return out

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "kind": self.kind,
            "params": {n: [list(p.shape), p.dtype] for n, p in sorted(self.params.items())},
            "shards": {
                n: [[s.rank, [list(b) for b in s.box], s.local_offset] for s in sh]
                for n, sh in sorted(self.shards.items())
            },
        }

    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


@dataclass(frozen=True, slots=True)
class Piece:
    """``engine_local[dst_box] = transform(trainer_full[src][src_box])``.

    ``dst_box`` and ``src_box`` hold the same elements in the same row-major order: their shapes
    agree once size-1 dims are dropped (per-expert HF tensors land in 3-D fused engine tensors).
    ``transform`` is ``"copy"`` (with a cast to the engine tensor's dtype), ``"fp8_block"`` (128x128
    block e4m3 quantisation of the weight) or ``"fp8_scale"`` (the matching inverse scales: then
    ``src_box`` is in weight coordinates and ``dst_box`` in scale coordinates).
    """

    dst_box: Box
    src: str
    src_box: Box
    transform: str = "copy"


@dataclass(frozen=True, slots=True)
class EngineTensor:
    """One tensor on one engine rank, under the engine's own name, local shape and dtype.

    ``shape`` is what the engine allocates. Where the engine pads (vLLM's vocabulary, its CPU
    MoE kernel's intermediate size), ``logical_shape`` is the name map's shape and the pieces'
    ``dst_box`` are already in the engine's (padded) coordinates: they fill the logical sub-box
    and never the padding (see ``layout/padding.py``). None when the two shapes agree."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]
    logical_shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return box_numel(full_box(self.shape)) * DTYPE_BYTES[self.dtype]

    @property
    def logical_numel(self) -> int:
        """Elements the pieces fill: the logical shape's (the whole tensor when not padded)."""
        return box_numel(full_box(self.shape if self.logical_shape is None else self.logical_shape))

    def to_json(self) -> list:
        """``[shape, dtype, pieces]`` plus ``logical_shape`` when padded (so unpadded tensors,
        and the fingerprints of layouts holding only those, are unchanged)."""
        out: list = [list(self.shape), self.dtype,
                     [[[list(b) for b in p.dst_box], p.src, [list(b) for b in p.src_box], p.transform]
                      for p in self.pieces]]
        if self.logical_shape is not None:
            out.append(list(self.logical_shape))
        return out


@dataclass(slots=True)
class EngineLayout:
    """Every engine rank's tensors. ``tensors[rank][engine_name]``.

    ``replica_of[rank]`` names the replica (data-parallel engine) each rank belongs to; ranks of
    different replicas receive the same bytes independently.
    """

    world_size: int
    tensors: dict[int, dict[str, EngineTensor]]
    replica_of: dict[int, int] = field(default_factory=dict)
    kind: str = "custom"
    description: str = ""

    def validate(self, params: dict[str, ParamSpec]) -> None:
        """Each piece reads an existing parameter inside its bounds, pieces fill each engine
        tensor exactly once, shapes agree. Raises LayoutError naming rank, tensor and parameter."""
        for rank, tensors in self.tensors.items():
            if not 0 <= rank < self.world_size:
                raise LayoutError(f"engine rank {rank} outside world size {self.world_size}")
            for tname, t in tensors.items():
                _check_dtype(t.dtype, f"engine rank {rank} tensor {tname!r}")
                filled = 0
                for p in t.pieces:
                    spec = params.get(p.src)
                    if spec is None:
                        raise LayoutError(
                            f"engine rank {rank} tensor {tname!r} reads trainer parameter {p.src!r}, "
                            "which the model does not have"
                        )
                    if len(p.src_box) != len(spec.shape) or any(
                        not (0 <= s < e <= n) for (s, e), n in zip(p.src_box, spec.shape)
                    ):
                        raise LayoutError(
                            f"engine rank {rank} tensor {tname!r}: box {p.src_box} outside parameter "
                            f"{p.src!r} of shape {spec.shape}"
                        )
                    if len(p.dst_box) != len(t.shape) or any(
                        not (0 <= s < e <= n) for (s, e), n in zip(p.dst_box, t.shape)
                    ):
                        raise LayoutError(
                            f"engine rank {rank} tensor {tname!r}: destination box {p.dst_box} outside local shape {t.shape}"
                        )
                    if p.transform != "fp8_scale" and squeeze_shape(box_shape(p.dst_box)) != squeeze_shape(
                        box_shape(p.src_box)
                    ):
                        raise LayoutError(
                            f"engine rank {rank} tensor {tname!r}: region {box_shape(p.dst_box)} cannot take "
                            f"{box_shape(p.src_box)} of parameter {p.src!r}"
                        )
                    filled += box_numel(p.dst_box)
                if t.logical_shape is not None and (len(t.logical_shape) != len(t.shape) or any(
                        not 0 <= lg <= n for lg, n in zip(t.logical_shape, t.shape))):
                    raise LayoutError(
                        f"engine rank {rank} tensor {tname!r}: logical shape {t.logical_shape} does not fit the "
                        f"engine's (padded) shape {t.shape}"
                    )
                if filled != t.logical_numel:
                    what = "" if t.logical_shape is None else f" (logical shape {t.logical_shape} of {t.shape})"
                    raise LayoutError(
                        f"engine rank {rank} tensor {tname!r}: pieces fill {filled} of "
                        f"{t.logical_numel} elements{what}"
                    )

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "kind": self.kind,
            "replica_of": {str(r): v for r, v in sorted(self.replica_of.items())},
            "tensors": {
                str(rank): {n: t.to_json() for n, t in sorted(ts.items())}
                for rank, ts in sorted(self.tensors.items())
            },
        }

    def fingerprint(self) -> str:
        return fingerprint(self.to_json())
