"""Control plane: the small-message side channel of a sync (metadata, plan hashes, versions, barriers).

Bytes never travel here, only what the transports need to find each other: NIXL agent metadata,
receive-buffer addresses, per-version "ready"/"done"/"flipped" markers and checksums. Every read
has a deadline, so a missing peer is a :class:`~fastsync.errors.SyncError` naming the key, never a
hang.

:class:`ControlPlane` is the interface; :class:`TCPStoreControl` backs it with
``torch.distributed.TCPStore`` (bound to 127.0.0.1 by default) for standalone use. Host adapters
(Ray-based verl / OpenRLHF) can back it with a Ray actor by implementing the four abstract methods.

Example::

    ctl = TCPStoreControl.server(port=0)            # on the process that owns the store
    peer = TCPStoreControl.client(port=ctl.port)    # everywhere else
    peer.set("recv/0/meta", b"...")
    ctl.get("recv/0/meta", timeout_s=10)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from datetime import timedelta

from fastsync.errors import ConfigError, SyncError

__all__ = ["ControlPlane", "TCPStoreControl", "DEFAULT_HOST"]

DEFAULT_HOST = "127.0.0.1"


class ControlPlane(ABC):
    """Key/value store with deadlines, counters and barriers, shared by all ranks of a sync.

    Backends implement ``_set``, ``_try_get`` (None when absent), ``_add`` and ``_delete``; the
    waiting, deadlines and barriers live here so every backend fails the same way.
    """

    poll_interval_s: float = 0.0005

    def __init__(self, prefix: str = "fs") -> None:
        self.prefix = prefix

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    # ---- backend ------------------------------------------------------------------------
    @abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def _try_get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _add(self, key: str, amount: int) -> int: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    # ---- public -------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._set(self._key(key), value.encode() if isinstance(value, str) else bytes(value))

    def try_get(self, key: str) -> bytes | None:
        return self._try_get(self._key(key))

    def get(self, key: str, timeout_s: float, what: str = "") -> bytes:
        """The value of ``key``, waiting at most ``timeout_s``; SyncError naming the key (and
        ``what`` it stands for, e.g. "receiver rank 1") when it does not appear."""
        deadline = time.monotonic() + timeout_s
        sleep = self.poll_interval_s
        while True:
            got = self._try_get(self._key(key))
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise SyncError(f"control plane: {what or 'peer'} did not publish {key!r} within {timeout_s:.1f} s")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)

    def add(self, key: str, amount: int = 1) -> int:
        return self._add(self._key(key), amount)

    def delete(self, key: str) -> None:
        self._delete(self._key(key))

    def barrier(self, name: str, num_ranks: int, timeout_s: float) -> None:
        """Block until ``num_ranks`` callers reached ``name`` (use a fresh name per barrier)."""
        if self.add(f"barrier/{name}", 1) >= num_ranks:
            self.set(f"barrier/{name}/go", b"1")
            return
        self.get(f"barrier/{name}/go", timeout_s, what=f"barrier {name!r} ({num_ranks} ranks)")


class TCPStoreControl(ControlPlane):
    """:class:`ControlPlane` on a ``torch.distributed.TCPStore``.

    The same store can seed ``torch.distributed.init_process_group`` (``.store``), which the
    ``torch`` and ``rank0`` transports use.
    """

    def __init__(self, store: object, port: int, host: str = DEFAULT_HOST, prefix: str = "fs") -> None:
        super().__init__(prefix)
        self.store = store
        self.port = port
        self.host = host

    @classmethod
    def server(cls, port: int = 0, host: str = DEFAULT_HOST, timeout_s: float = 60.0, prefix: str = "fs") -> "TCPStoreControl":
        """Start the store in this process (``port=0`` picks a free port; read it from ``.port``)."""
        from torch.distributed import TCPStore

        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                         use_libuv=True)
        return cls(store, store.port, host, prefix)

    @classmethod
    def client(cls, port: int, host: str = DEFAULT_HOST, timeout_s: float = 60.0, prefix: str = "fs") -> "TCPStoreControl":
        """Connect to a store another process started."""
        if port <= 0:
            raise ConfigError(f"control plane port must be positive, got {port}")
        from torch.distributed import TCPStore

        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        except (RuntimeError, TimeoutError) as e:
            raise SyncError(f"control plane: cannot reach TCPStore at {host}:{port}: {e}") from e
        return cls(store, port, host, prefix)

    def with_prefix(self, prefix: str) -> "TCPStoreControl":
        """A view of the same store under another key prefix (one per transport or job)."""
        return TCPStoreControl(self.store, self.port, self.host, prefix)

    def _set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def _try_get(self, key: str) -> bytes | None:
        if not self.store.check([key]):
            return None
        return self.store.get(key)

    def _add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))

    def _delete(self, key: str) -> None:
        self.store.delete_key(key)
