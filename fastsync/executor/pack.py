"""Packing: slice, cast or quantise each planned piece into its fixed place in the staging arena.

The bytes a piece leaves in staging are exactly the bytes that must land in the destination box,
in the destination's row-major order, so one contiguous WRITE (or a few, when the destination
box is strided) moves them. Transforms other than a plain copy come from the transform registry
(``fastsync_register_transforms``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastsync import plugins
from fastsync.errors import ConfigError, PlanError
from fastsync.executor.program import Chunk, SendItem, SendProgram, locate_source
from fastsync.executor.staging import as_bytes, torch_dtype
from fastsync.executor.verify import Digests, storage_buffers
from fastsync.layout.box import box_numel, box_shape, box_slices, to_local
from fastsync.layout.types import Shard
from fastsync.plan.types import Transfer

__all__ = ["Packer", "source_view", "transform_into"]


def source_view(
    t: Transfer,
    sources: dict[str, torch.Tensor],
    shards: dict[str, list[Shard]],
    gathered: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The trainer-side view of ``t.src_box``: from a gathered full tensor when the transfer
    reads one, else from the local shard that holds it (``Shard`` offsets into the local buffer)."""
    if t.gathered:
        full = (gathered or {}).get(t.src_param)
        if full is None:
            raise PlanError(f"transfer of {t.src_param!r} reads a gathered full tensor that rank {t.src_rank} does not hold")
        return full[box_slices(t.src_box)]
    buf = sources.get(t.src_param)
    if buf is None:
        raise PlanError(f"trainer rank {t.src_rank} has no local tensor for parameter {t.src_param!r}")
    sh = locate_source(t, shards.get(t.src_param, []))
    flat = buf.reshape(-1)
    n = box_numel(sh.box)
    local = flat[sh.local_offset: sh.local_offset + n].view(box_shape(sh.box))
    return local[box_slices(to_local(t.src_box, sh.box))]


def transform_into(out_u8: torch.Tensor, src: torch.Tensor, transform: str, dst_dtype: str) -> None:
    """Write ``transform(src)`` cast to ``dst_dtype`` into the flat uint8 region ``out_u8``."""
    if transform == "copy":
        out_u8.view(torch_dtype(dst_dtype)).view(src.shape).copy_(src)
        return
    reg = plugins.transforms().get(transform)
    if reg is None:
        raise ConfigError(f"plan uses transform {transform!r}, which no plugin registered")
    got = reg.obj(src, torch_dtype(dst_dtype))
    got_u8 = as_bytes(got.contiguous())
    if got_u8.numel() != out_u8.numel():
        raise PlanError(f"transform {transform!r} produced {got_u8.numel()} bytes, plan expects {out_u8.numel()}")
    out_u8.copy_(got_u8)


class Packer:
    """Fills staging slots for a :class:`SendProgram` and hands out each item's bytes."""

    def __init__(
        self,
        program: SendProgram,
        staging: torch.Tensor,
        sources: dict[str, torch.Tensor],
        shards: dict[str, list[Shard]],
        gathered: dict[str, torch.Tensor] | None = None,
        check: bool = True,
    ) -> None:
        staged = check and any(not it.direct for c in program.chunks for it in c.items)
        if staged and staging.numel() < program.staging_bytes:
            raise ConfigError(f"staging buffer of {staging.numel()} bytes, program needs {program.staging_bytes}")
        self.program = program
        self.staging = staging
        self.sources = sources
        self.shards = shards
        self.gathered = gathered
        self._feeds: dict[int, tuple[Chunk, tuple, tuple]] = {}  # chunk index -> (chunk, addresses, feeds)

    def base(self, it: SendItem) -> torch.Tensor:
        """The flat uint8 buffer ``it.src_runs`` index: staging, or the source's local buffer."""
        return as_bytes(self.sources[it.transfer.src_param]) if it.direct else self.staging

    def segment_views(self, it: SendItem) -> list[tuple[torch.Tensor, int]]:
        """``(source bytes, destination byte offset)`` for each contiguous piece of ``it``."""
        base = self.base(it)
        return [(base[s: s + n], d) for s, d, n in it.segments()]

    def _digest(self, chunk: Chunk, digests: Digests) -> None:
        """Feed every item of ``chunk`` into ``digests`` in one batch over the memory the items
        read (staging, the sources' storages): a sample costs its bytes, not a step per item."""
        bases, feeds = self._digest_feeds(chunk)
        digests.feed_batch(bases, feeds)

    def _digest_feeds(self, chunk: Chunk) -> tuple[list[torch.Tensor], list]:
        """``chunk``'s items as :meth:`Digests.feed_batch` feeds, in item order; kept per chunk (the
        same list every version, which lets a sample compile once) while staging and the sources
        stay where they were."""
        params = sorted({it.transfer.src_param for it in chunk.items if it.direct})
        sig = (self.staging.data_ptr(), self.staging.numel(),
               tuple((self.sources[p].data_ptr(), self.sources[p].numel()) for p in params))
        hit = self._feeds.get(chunk.index)
        if hit is not None and hit[0] is chunk and hit[1] == sig:
            return hit[2]
        items = [it for it in chunk.items if it.src_runs]
        bases, where = storage_buffers([self.base(it) for it in items])
        feeds = [(it.index, b, [(o + off, n) for o, n in it.src_runs] if off else it.src_runs)
                 for it, (b, off) in zip(items, where)]
        self._feeds[chunk.index] = (chunk, sig, (bases, feeds))
        return bases, feeds

    def pack(self, chunk: Chunk, crcs: Digests | None = None) -> None:
        """Transform every staged item of ``chunk`` into its slot; with ``crcs``, then feed each
        item's bytes into its transfer's digest (items of one transfer come in order)."""
        for it in chunk.items:
            if not it.direct:
                t = it.transfer
                dst_dtype = self.program.dst_info[t.dst_rank][t.dst_tensor].dtype
                src = source_view(t, self.sources, self.shards, self.gathered)
                out = self.staging[it.stage_offset: it.stage_offset + t.nbytes]
                transform_into(out, src, t.transform, dst_dtype)
        if crcs is not None:
            self._digest(chunk, crcs)


PackFn = Callable[[Chunk], None]
