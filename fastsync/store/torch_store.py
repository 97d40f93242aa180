"""A ``torch.distributed.Store`` over fastsync's authenticated control store.

The ``torch`` and ``rank0`` transports (and the demo's trainer group) create their gloo group on
the control plane; this adapter gives ``init_process_group`` the store's connection, so the
rendezvous is as authenticated as everything else (no second, open ``TCPStore`` listener).
"""

from __future__ import annotations

import struct
import time
from datetime import timedelta

import torch.distributed as dist

from fastsync.store.kv import ABSENT, ADD, CMPSET, DELETE, GET, NUMKEYS, SET

__all__ = ["TorchStore"]


def _b(v: object) -> bytes:
    if isinstance(v, str):
        return v.encode()
    return bytes(v)  # bytes, or the list[int] torch passes


class TorchStore(dist.Store):
    """``set``/``get``/``add``/``wait``/``check``/``compare_set``/``delete_key`` on a store
    backend (:class:`~fastsync.store.kv.StoreClient` or the server's local one). ``get``
    and ``wait`` block at most the store's timeout, then raise (as torch's stores do)."""

    def __init__(self, backend: object, timeout_s: float) -> None:
        super().__init__()
        self.backend = backend
        self.timeout_s = timeout_s

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def set(self, key: str, value: object) -> None:
        self.backend.request(SET, key, _b(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.backend.request(GET, key)[1]

    def add(self, key: str, amount: int) -> int:
        return struct.unpack(">q", self.backend.request(ADD, key, struct.pack(">q", amount))[1])[0]

    def check(self, keys: list[str]) -> bool:
        return all(self.backend.request(GET, k)[0] != ABSENT for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        sleep = 0.0005
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"control store: keys {keys} did not appear within {limit:.1f} s")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.01)

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        e, d = _b(expected), _b(desired)
        return self.backend.request(CMPSET, key, struct.pack(">Q", len(e)) + e + d)[1]

    def delete_key(self, key: str) -> bool:
        return self.backend.request(DELETE, key)[0] != ABSENT

    def num_keys(self) -> int:
        return struct.unpack(">q", self.backend.request(NUMKEYS, "")[1])[0]
