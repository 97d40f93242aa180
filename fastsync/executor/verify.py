"""Checksum verification: proves a receiver holds exactly the bytes the trainers meant to send.

Each planned transfer gets a CRC-32 of its destination bytes in row-major order of its
destination box. Senders compute it from what they packed (or from the source, for direct
writes); receivers compute it from what landed; mismatches are reported by tensor name and
sending rank. Used by the tests and by ``fastsync bench``; off by default in production syncs.
"""

from __future__ import annotations

import zlib

import torch

from fastsync.executor.program import RecvProgram

__all__ = ["crc_update", "receiver_checksums", "compare_checksums"]


def crc_update(crc: int, data_u8: torch.Tensor) -> int:
    """Chain the bytes of a flat, contiguous uint8 CPU tensor into ``crc``."""
    if data_u8.numel() == 0:
        return crc
    if data_u8.device.type != "cpu":
        data_u8 = data_u8.cpu()
    return zlib.crc32(data_u8.numpy(), crc)


def receiver_checksums(program: RecvProgram, regions: dict[str, torch.Tensor]) -> dict[int, int]:
    """Per planned transfer index, the CRC of what landed in its destination box."""
    out: dict[int, int] = {}
    for _, items in program.by_origin():
        for it in items:
            region = regions[it.transfer.dst_tensor]
            crc = 0
            for off, n in it.dst_runs:
                crc = crc_update(crc, region[off: off + n])
            out[it.index] = crc
    return out


def compare_checksums(program: RecvProgram, expected: dict[int, int], got: dict[int, int]) -> list[str]:
    """Human-readable mismatches (empty when every transfer matches)."""
    bad: list[str] = []
    for src, items in program.by_origin():
        for it in items:
            if it.index not in expected:
                bad.append(f"transfer {it.index} ({it.transfer.dst_tensor!r} from trainer rank {src}): no sender checksum")
            elif expected[it.index] != got.get(it.index):
                bad.append(
                    f"transfer {it.index} ({it.transfer.dst_tensor!r} box {it.transfer.dst_box} from trainer rank {src}): "
                    "checksum mismatch"
                )
    return bad
