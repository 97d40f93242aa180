"""Control plane: the small-message side channel of a sync (metadata, plan hashes, versions, barriers).

Bytes never travel here, only what the transports need to find each other: NIXL agent metadata,
receive-buffer addresses, per-version "ready"/"done"/"flipped" markers and checksums. Every read
has a deadline, so a missing peer is a :class:`~fastsync.errors.SyncError` naming the key, never a
hang.

:class:`ControlPlane` is the interface; :class:`TCPStoreControl` backs it with fastsync's own
authenticated, encrypted store (bound to 127.0.0.1 by default; see :mod:`fastsync.store.kv`)
for standalone use. Host adapters (Ray-based verl / OpenRLHF) can back it with a Ray actor by
implementing the four abstract methods (and setting ``secret``, the job secret the NIXL
notifications and engine requests are signed with).

Example::

    ctl = TCPStoreControl.server(port=0)            # on the process that owns the store
    peer = TCPStoreControl.client(port=ctl.port)    # everywhere else
    peer.set("recv/0/meta", b"...")
    ctl.get("recv/0/meta", timeout_s=10)
"""

from __future__ import annotations

import struct
import time
from abc import ABC, abstractmethod

from fastsync.store.kv import (ABSENT, ADD, CMPSET, DEFAULT_MAX_VALUE_BYTES, DELETE, GET, ON_CLOSE, SET, KVState,
                                    StoreClient, StoreServer, StoreUnreachable)
from fastsync.errors import ConfigError, SyncError, TransportError
from fastsync.protocol import barrier_go_key, barrier_key
from fastsync.security import job_secret

__all__ = ["ControlPlane", "TCPStoreControl", "DEFAULT_HOST", "StoreUnreachable"]

DEFAULT_HOST = "127.0.0.1"


class ControlPlane(ABC):
    """Key/value store with deadlines, counters and barriers, shared by all ranks of a sync.

    Backends implement ``_set``, ``_try_get`` (None when absent), ``_add`` and ``_delete``, each
    bounded by ``timeout_s`` (None: the backend's own default) and raising
    :class:`~fastsync.store.kv.StoreUnreachable` when the store does not answer in time; the
    waiting, deadlines and barriers live here so every backend fails the same way. A wait
    (:meth:`get`, :meth:`barrier`) counts an unreachable store as "not there yet" until its deadline,
    then names both the key and the store's last error: a link that flaps inside the deadline costs
    nothing.
    """

    poll_interval_s: float = 0.0005
    secret: bytes | None = None  # the job secret (keys for NIXL notifications, engine requests)

    def __init__(self, prefix: str = "fs") -> None:
        self.prefix = prefix

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    # ---- backend ------------------------------------------------------------------------
    @abstractmethod
    def _set(self, key: str, value: bytes, timeout_s: float | None = None) -> None: ...

    @abstractmethod
    def _try_get(self, key: str, timeout_s: float | None = None) -> bytes | None: ...

    @abstractmethod
    def _add(self, key: str, amount: int, timeout_s: float | None = None) -> int: ...

    @abstractmethod
    def _delete(self, key: str, timeout_s: float | None = None) -> None: ...

    # ---- public -------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str, timeout_s: float | None = None) -> None:
        self._set(self._key(key), value.encode() if isinstance(value, str) else bytes(value), timeout_s)

    def try_get(self, key: str, timeout_s: float | None = None) -> bytes | None:
        return self._try_get(self._key(key), timeout_s)

    def get(self, key: str, timeout_s: float, what: str = "") -> bytes:
        """The value of ``key``, waiting at most ``timeout_s``; SyncError naming the key (and
        ``what`` it stands for, e.g. "receiver rank 1") when it does not appear. An unreachable
        store is retried until the deadline, and then named."""
        deadline = time.monotonic() + timeout_s
        sleep = self.poll_interval_s
        last: StoreUnreachable | None = None
        while True:
            try:
                got = self._try_get(self._key(key), max(deadline - time.monotonic(), 0.05))
                last = None
            except StoreUnreachable as e:
                got, last = None, e
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                why = f"; the store was unreachable: {last}" if last is not None else ""
                raise SyncError(f"control plane: {what or 'peer'} did not publish {key!r} within {timeout_s:.1f} s"
                                + why)
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)

    def add(self, key: str, amount: int = 1, timeout_s: float | None = None) -> int:
        return self._add(self._key(key), amount, timeout_s)

    def delete(self, key: str, timeout_s: float | None = None) -> None:
        self._delete(self._key(key), timeout_s)

    def on_close(self, key: str, value: bytes) -> bool:
        """Ask the store to set ``key`` to ``value`` when this connection ends without a clean
        close (the process died). False where the backend cannot (the store's own process)."""
        return False

    def local_address(self) -> str:
        """The address this process reaches the store from ("" where there is no connection)."""
        return ""

    def dedicated(self) -> "ControlPlane":
        """A second connection to the same store (a heartbeat's own, so it never waits behind, or
        holds up, the sync's requests); this plane itself where it has no connection."""
        return self

    def barrier(self, name: str, num_ranks: int, timeout_s: float) -> None:
        """Block until ``num_ranks`` callers reached ``name`` (use a fresh name per barrier)."""
        if self.add(barrier_key(name), 1) >= num_ranks:
            self.set(barrier_go_key(name), b"1")
            return
        self.get(barrier_go_key(name), timeout_s, what=f"barrier {name!r} ({num_ranks} ranks)")


class TCPStoreControl(ControlPlane):
    """:class:`ControlPlane` on fastsync's authenticated key/value store
    (:mod:`fastsync.store.kv`): it listens on ``host`` only (127.0.0.1 by default), talks only
    to clients holding the job ``secret`` (see :mod:`fastsync.security`), and encrypts every
    message, so agent metadata, addresses and plans never cross the network in the clear.
    (The name is kept from when it wrapped ``torch.distributed.TCPStore``.)

    ``.store`` is a ``torch.distributed.Store`` over the same connection, so the store can seed
    ``torch.distributed.init_process_group`` (the ``torch`` and ``rank0`` transports do).
    ``max_value_bytes`` bounds one value (a Kimi-K2 256 -> 128 plan is about 64 MiB); larger
    values are refused with a ConfigError naming the key and size, before anything is sent.
    """

    def __init__(self, backend: object, port: int, host: str = DEFAULT_HOST, prefix: str = "fs", *,
                 secret: bytes, timeout_s: float = 60.0, server: object | None = None) -> None:
        super().__init__(prefix)
        self.backend = backend  # StoreClient, or the server's KVState in its own process
        self.port = port
        self.host = host
        self.secret = secret
        self.timeout_s = timeout_s
        self._server = server
        self._store: object | None = None

    @classmethod
    def server(cls, port: int = 0, host: str = DEFAULT_HOST, timeout_s: float = 60.0, prefix: str = "fs", *,
               secret: bytes | str | None = None, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> "TCPStoreControl":
        """Start the store in this process (``port=0`` picks a free port; read it from ``.port``).
        ``secret``: the job secret (default: ``$FASTSYNC_JOB_SECRET``, else a new one, exported
        to this process's environment for the processes it spawns; read it from ``.secret``)."""
        if timeout_s <= 0:
            raise ConfigError(f"control plane timeout_s must be positive, got {timeout_s}")
        key = job_secret(secret, create=True)
        srv = StoreServer(key, host, port, max_value_bytes=max_value_bytes)
        return cls(_LocalBackend(srv.state, max_value_bytes), srv.port, host, prefix, secret=key, timeout_s=timeout_s,
                   server=srv)

    @classmethod
    def client(cls, port: int, host: str = DEFAULT_HOST, timeout_s: float = 60.0, prefix: str = "fs", *,
               secret: bytes | str | None = None, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> "TCPStoreControl":
        """Connect to a store another process started; ``secret`` as for :meth:`server` (but
        never invented: without one this is a ConfigError)."""
        if port <= 0:
            raise ConfigError(f"control plane port must be positive, got {port}")
        if timeout_s <= 0:
            raise ConfigError(f"control plane timeout_s must be positive, got {timeout_s}")
        key = job_secret(secret)
        try:
            backend = StoreClient(key, host, port, timeout_s, max_value_bytes=max_value_bytes)
        except TransportError as e:
            raise SyncError(str(e)) from e
        return cls(backend, port, host, prefix, secret=key, timeout_s=timeout_s)

    def with_prefix(self, prefix: str) -> "TCPStoreControl":
        """A view of the same store under another key prefix (one per transport or job)."""
        view = TCPStoreControl(self.backend, self.port, self.host, prefix, secret=self.secret,
                               timeout_s=self.timeout_s)
        view._store = self._store
        return view

    @property
    def store(self) -> object:
        """A ``torch.distributed.Store`` on this connection (for ``init_process_group``)."""
        if self._store is None:
            from fastsync.store.torch_store import TorchStore

            self._store = TorchStore(self.backend, self.timeout_s)
        return self._store

    def _set(self, key: str, value: bytes, timeout_s: float | None = None) -> None:
        self.backend.request(SET, key, value, timeout_s)

    def _try_get(self, key: str, timeout_s: float | None = None) -> bytes | None:
        status, value = self.backend.request(GET, key, b"", timeout_s)
        return None if status == ABSENT else value

    def _add(self, key: str, amount: int, timeout_s: float | None = None) -> int:
        return struct.unpack(">q", self.backend.request(ADD, key, struct.pack(">q", amount), timeout_s)[1])[0]

    def _delete(self, key: str, timeout_s: float | None = None) -> None:
        self.backend.request(DELETE, key, b"", timeout_s)

    def on_close(self, key: str, value: bytes) -> bool:
        if self._server is not None or not isinstance(self.backend, StoreClient):
            return False
        self.backend.request(ON_CLOSE, self._key(key), bytes(value))
        return True

    def local_address(self) -> str:
        if self._server is not None:
            return self.host
        sock = getattr(self.backend, "sock", None)
        try:
            return str(sock.getsockname()[0]) if sock is not None else ""
        except OSError:
            return ""

    def dedicated(self) -> "TCPStoreControl":
        if self._server is not None or not isinstance(self.backend, StoreClient):
            return self
        return TCPStoreControl.client(self.port, self.host, self.timeout_s, self.prefix, secret=self.secret,
                                      max_value_bytes=self.backend.max_value_bytes)

    def close(self, bye: bool = False) -> None:
        """Drop the connection (and stop the store, on its own process). ``bye``: a clean close,
        cancelling the connection's on-close keys."""
        if self._server is not None:
            self._server.close()
        elif isinstance(self.backend, StoreClient):
            self.backend.close(bye=bye)
        elif hasattr(self.backend, "close"):
            self.backend.close()


class _LocalBackend:
    """The server process's own access to the store: the same requests, no socket."""

    def __init__(self, state: KVState, max_value_bytes: int) -> None:
        self.state = state
        self.max_value_bytes = max_value_bytes

    def request(self, op: bytes, key: str, value: bytes = b"", timeout_s: float | None = None) -> tuple[bytes, bytes]:
        if op in (SET, CMPSET) and len(value) > self.max_value_bytes:
            raise ConfigError(f"control plane: value for key {key!r} is {len(value)} bytes "
                              f"({len(value) / 2**20:.1f} MiB), over the limit of {self.max_value_bytes} bytes "
                              f"({self.max_value_bytes / 2**20:.0f} MiB; max_value_bytes=)")
        return self.state.apply(op, key, value)
