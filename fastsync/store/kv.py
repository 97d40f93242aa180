"""The control store: a small key/value server that only talks to holders of the job secret.

Handshake (fixed sizes, nothing read from the peer decides an allocation)::

    client -> server   b"FSC1" + client_nonce[32]
    server -> client   server_nonce[32] + HMAC(k_auth, "server", cn, sn)[32]
    client -> server   HMAC(k_auth, "client", cn, sn)[32]

Both sides prove they hold the secret (a client never talks to an impostor store either); a
client that fails is disconnected and counted, and the server keeps serving the others. Then
every frame is AES-GCM under a per-connection key pair (HKDF of the secret and both nonces, one
key per direction) with the frame's sequence number as nonce: frames cannot be read, forged,
replayed, reordered or moved to another connection.

A message (request or reply) is one or more frames: the first carries the message's total length
and SHA-256, checked against ``max_value_bytes`` before anything is allocated; frames hold at
most ``CHUNK_BYTES`` each, so a 64 MiB plan travels as 64 checked frames.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from fastsync.errors import ConfigError, TransportError
from fastsync.security import derive_key

__all__ = ["StoreServer", "StoreClient", "KVState", "DEFAULT_MAX_VALUE_BYTES", "CHUNK_BYTES", "HandshakeError",
           "StoreUnreachable"]

log = logging.getLogger("fastsync.control")

MAGIC = b"FSC1"
NONCE_BYTES = 32
CHUNK_BYTES = 1 << 20
_TAG = 16
_HDR = struct.Struct(">Q32s")  # total length, sha256 of the whole message
MAX_FRAME = CHUNK_BYTES + _HDR.size + _TAG
DEFAULT_MAX_VALUE_BYTES = 512 << 20
MAX_KEY_BYTES = 4096
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING_HANDSHAKES = 64  # connections not yet authenticated; more are closed at once

# request ops. ON_CLOSE registers a key/value the server sets when this connection ends without a
# BYE (its process died or was cut off for good): a heartbeat's death notice.
SET, GET, ADD, DELETE, CMPSET, NUMKEYS, ON_CLOSE, BYE = b"S", b"G", b"A", b"D", b"C", b"N", b"E", b"X"
OK, ABSENT, ERR = b"\x00", b"\x01", b"\x02"


class HandshakeError(TransportError):
    """The peer does not hold the job secret (or does not speak this protocol)."""


class _HandshakeCut(ConnectionError):
    """The server closed or reset the connection before its proof arrived (retried; private)."""


class StoreUnreachable(TransportError):
    """The store did not answer a request within its deadline (a partitioned or overloaded link),
    or the connection to it broke. The client reconnects on its next request."""


def _no_delay(sock: socket.socket) -> None:
    """Send small frames at once. Without it the client's handshake proof and its first request
    are two small writes in a row: Nagle holds the request until the proof is ACKed, and the
    server delays that ACK (~40 ms on Linux), so every new connection's first call took 40 ms."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


class _Channel:
    """One authenticated, encrypted connection (either side)."""

    def __init__(self, sock: socket.socket, secret: bytes, cn: bytes, sn: bytes, is_server: bool) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.sock = sock
        c2s = derive_key(secret, "control session c2s", salt=cn + sn)
        s2c = derive_key(secret, "control session s2c", salt=cn + sn)
        self._tx = AESGCM(s2c if is_server else c2s)
        self._rx = AESGCM(c2s if is_server else s2c)
        self._tx_seq = 0
        self._rx_seq = 0

    def _send_frame(self, plain: bytes) -> None:
        nonce = self._tx_seq.to_bytes(12, "big")
        self._tx_seq += 1
        ct = self._tx.encrypt(nonce, plain, None)
        self.sock.sendall(struct.pack(">I", len(ct)) + ct)

    def _recv_frame(self) -> bytes:
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if not _TAG <= n <= MAX_FRAME:
            raise TransportError(f"control store: frame of {n} bytes outside 16..{MAX_FRAME}")
        ct = _recv_exact(self.sock, n)
        nonce = self._rx_seq.to_bytes(12, "big")
        self._rx_seq += 1
        from cryptography.exceptions import InvalidTag

        try:
            return self._rx.decrypt(nonce, ct, None)
        except InvalidTag as e:
            raise TransportError("control store: a frame failed authentication (forged, replayed or reordered)") from e

    def send(self, payload: bytes) -> None:
        head = _HDR.pack(len(payload), hashlib.sha256(payload).digest())
        view = memoryview(payload)
        self._send_frame(head + bytes(view[:CHUNK_BYTES]))
        for i in range(CHUNK_BYTES, len(payload), CHUNK_BYTES):
            self._send_frame(bytes(view[i:i + CHUNK_BYTES]))

    def recv(self, max_bytes: int, too_big: Callable[[int, bytes], Exception]) -> bytes:
        """One message; when its announced length exceeds ``max_bytes``, its frames are read and
        dropped one at a time (nothing of that size is allocated) and ``too_big(total,
        first_frame)`` is raised, leaving the connection usable."""
        first = self._recv_frame()
        if len(first) < _HDR.size:
            raise TransportError("control store: message header truncated")
        total, digest = _HDR.unpack_from(first)
        if total > max_bytes:
            left = total - (len(first) - _HDR.size)
            while left > 0:
                left -= len(self._recv_frame())
            raise too_big(total, first[_HDR.size:])
        buf = bytearray(total)
        part = first[_HDR.size:]
        got = len(part)
        if got > total:
            raise TransportError("control store: frame longer than its message")
        buf[:got] = part
        while got < total:
            part = self._recv_frame()
            if got + len(part) > total:
                raise TransportError("control store: frame longer than its message")
            buf[got:got + len(part)] = part
            got += len(part)
        if not hmac.compare_digest(hashlib.sha256(buf).digest(), digest):
            raise TransportError("control store: message digest mismatch")
        return bytes(buf)


def _key_of(first: bytes) -> str:
    """The key named in a request's first bytes (for error messages), best effort."""
    if len(first) >= 3:
        (n,) = struct.unpack_from(">H", first, 1)
        return first[3:3 + n].decode(errors="replace")
    return "?"


def _pack_req(op: bytes, key: str, value: bytes = b"") -> bytes:
    k = key.encode()
    if len(k) > MAX_KEY_BYTES:
        raise ConfigError(f"control store key {key[:80]!r}... is {len(k)} bytes, over {MAX_KEY_BYTES}")
    return op + struct.pack(">H", len(k)) + k + value


class KVState:
    """The store's data: a dict behind a lock (the server's own process uses it directly)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def apply(self, op: bytes, key: str, value: bytes) -> tuple[bytes, bytes]:
        with self.lock:
            if op == SET:
                self.data[key] = value
                return OK, b""
            if op == GET:
                got = self.data.get(key)
                return (ABSENT, b"") if got is None else (OK, got)
            if op == ADD:
                (amount,) = struct.unpack(">q", value)
                n = int(self.data.get(key, b"0")) + amount
                self.data[key] = str(n).encode()
                return OK, struct.pack(">q", n)
            if op == DELETE:
                return (OK if self.data.pop(key, None) is not None else ABSENT), b""
            if op == CMPSET:
                (n,) = struct.unpack_from(">Q", value)
                expected, desired = value[8:8 + n], value[8 + n:]
                cur = self.data.get(key)
                if (cur is None and not expected) or cur == expected:
                    self.data[key] = desired
                    return OK, desired
                return OK, cur if cur is not None else expected
            if op == NUMKEYS:
                return OK, struct.pack(">q", len(self.data))
        return ERR, f"unknown control store op {op!r}".encode()


class StoreServer:
    """Accepts connections on ``host:port`` (that address only) and serves authenticated ones."""

    def __init__(self, secret: bytes, host: str, port: int = 0, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        self.secret = secret
        self.state = KVState()
        self.max_value_bytes = max_value_bytes
        self.refused = 0  # connections that failed the handshake
        self._auth = derive_key(secret, "control auth")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.sock = socket.create_server((host, port), family=family, backlog=512)
        except OSError as e:
            raise TransportError(f"control store: cannot listen on {host}:{port}: {e}") from e
        self.host, self.port = host, self.sock.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept, name="fastsync-store", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                self.refused += 1
                conn.close()  # a flood of unauthenticated connections is not served
                continue
            threading.Thread(target=self._serve, args=(conn,), name="fastsync-store-conn", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> _Channel:
        _no_delay(conn)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        hello = _recv_exact(conn, len(MAGIC) + NONCE_BYTES)
        if hello[:4] != MAGIC:
            raise HandshakeError("not a fastsync control store client")
        cn, sn = hello[4:], os.urandom(NONCE_BYTES)
        conn.sendall(sn + hmac.digest(self._auth, b"server" + cn + sn, "sha256"))
        proof = _recv_exact(conn, 32)
        if not hmac.compare_digest(proof, hmac.digest(self._auth, b"client" + cn + sn, "sha256")):
            raise HandshakeError("client does not hold the job secret")
        conn.settimeout(None)
        return _Channel(conn, self.secret, cn, sn, is_server=True)

    def _serve(self, conn: socket.socket) -> None:
        peer = "?"
        try:
            peer = "%s:%s" % conn.getpeername()[:2]
            ch = self._handshake(conn)
        except (OSError, ConnectionError, HandshakeError, struct.error) as e:
            self.refused += 1
            log.warning("control store: refused connection from %s: %s", peer, e)
            conn.close()
            return
        finally:
            self._pending.release()
        self._conns.add(conn)

        def too_big(total: int, first: bytes) -> Exception:
            return ConfigError(f"control store: value for key {_key_of(first)!r} is about {total} bytes, over the "
                               f"store's limit of {self.max_value_bytes} bytes (max_value_bytes=)")

        on_close: dict[str, bytes] = {}  # set when this connection ends without a BYE
        try:
            while True:
                try:
                    req = ch.recv(self.max_value_bytes + MAX_KEY_BYTES + 64, too_big)
                except ConfigError as e:  # an over-size value: refused, the connection stays
                    ch.send(ERR + str(e).encode())
                    continue
                op, (n,) = req[:1], struct.unpack_from(">H", req, 1)
                key = req[3:3 + n].decode()
                if op == ON_CLOSE:
                    if len(on_close) >= 16 and key not in on_close:
                        ch.send(ERR + b"at most 16 on-close keys per connection")
                        continue
                    on_close[key] = req[3 + n:]
                    ch.send(OK)
                    continue
                if op == BYE:
                    on_close.clear()
                    ch.send(OK)
                    continue
                status, out = self.state.apply(op, key, req[3 + n:])
                ch.send(status + out)
        except (OSError, ConnectionError, struct.error, UnicodeDecodeError):
            pass  # client went away (or sent garbage after authenticating): drop it
        except (ConfigError, TransportError) as e:
            log.warning("control store: dropping client %s: %s", peer, e)
        finally:
            self._conns.discard(conn)
            conn.close()
            for key, value in on_close.items():
                self.state.apply(SET, key, value)

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class StoreClient:
    """One authenticated connection to a :class:`StoreServer`; thread-safe (one request at a time).

    Every request has a deadline (``timeout_s`` of the call, else the client's): the lock, the
    send and the reply all count against it. A request that times out, or whose connection
    breaks, raises :class:`StoreUnreachable` naming the store and the key, and closes the
    connection (a late reply must not be read as the next request's); the next request connects
    again (within its own deadline). A request may or may not have been applied when it timed out.
    """

    def __init__(self, secret: bytes, host: str, port: int, timeout_s: float,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.max_value_bytes = max_value_bytes
        self.lock = threading.Lock()
        self._secret = secret
        self._auth = derive_key(secret, "control auth")
        self.reconnects = 0
        self.sock: socket.socket | None = None
        self.ch: _Channel | None = None
        self._connect(time.monotonic() + timeout_s)

    def _connect(self, deadline: float) -> None:
        """Connect and prove the secret within ``deadline``. A handshake the server cut before its
        proof arrived (over its pending-handshake limit, or a loaded host past its handshake
        timeout) is tried again until the deadline: a wrong secret fails the client's own check of
        the server's proof, never as a cut. Nothing listening (refused) fails at once."""
        nap = 0.05
        while True:
            try:
                self._connect_once(deadline)
                return
            except _HandshakeCut as e:
                if time.monotonic() + nap >= deadline:
                    raise HandshakeError(f"control plane: the store at {self.host}:{self.port} cut the handshake "
                                         f"and did not take this client again within the deadline: {e.__cause__}") from e
                log.info("control store %s:%s cut the handshake (%s): trying again", self.host, self.port, e.__cause__)
                time.sleep(nap)
                nap = min(2 * nap, 0.5)

    def _connect_once(self, deadline: float) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=left)
            _no_delay(sock)
        except OSError as e:
            raise TransportError(f"control plane: cannot reach the store at {self.host}:{self.port}: {e}") from e
        try:
            sock.settimeout(max(min(deadline - time.monotonic(), HANDSHAKE_TIMEOUT_S * 2), 0.001))
            cn = os.urandom(NONCE_BYTES)
            sock.sendall(MAGIC + cn)
            got = _recv_exact(sock, NONCE_BYTES + 32)
            sn, proof = got[:NONCE_BYTES], got[NONCE_BYTES:]
            if not hmac.compare_digest(proof, hmac.digest(self._auth, b"server" + cn + sn, "sha256")):
                raise HandshakeError(f"control plane: the store at {self.host}:{self.port} does not hold this job's secret")
            sock.sendall(hmac.digest(self._auth, b"client" + cn + sn, "sha256"))
        except socket.timeout as e:
            sock.close()
            raise HandshakeError(f"control plane: the store at {self.host}:{self.port} did not complete the "
                                 f"handshake in time: {e}") from e
        except (OSError, ConnectionError) as e:
            sock.close()
            raise _HandshakeCut(str(e)) from e
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.ch = _Channel(sock, self._secret, cn, sn, is_server=False)

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = self.ch = None

    def request(self, op: bytes, key: str, value: bytes = b"", timeout_s: float | None = None) -> tuple[bytes, bytes]:
        if op in (SET, CMPSET) and len(value) > self.max_value_bytes:
            raise ConfigError(f"control plane: value for key {key!r} is {len(value)} bytes "
                              f"({len(value) / 2**20:.1f} MiB), over the limit of {self.max_value_bytes} bytes "
                              f"({self.max_value_bytes / 2**20:.0f} MiB; max_value_bytes=)")

        def too_big(total: int, first: bytes) -> Exception:
            return ConfigError(f"control plane: the store's reply for key {key!r} is {total} bytes, over the "
                               f"limit of {self.max_value_bytes} bytes (max_value_bytes=)")

        limit = self.timeout_s if timeout_s is None else max(float(timeout_s), 0.0)
        deadline = time.monotonic() + limit
        where = f"the store at {self.host}:{self.port} (request for key {key!r})"
        if not self.lock.acquire(timeout=max(limit, 0.001)):
            raise StoreUnreachable(f"control plane: {where}: another request of this process held the connection "
                                   f"for {limit:.1f} s (the store is unreachable or slow)")
        try:
            if self.sock is None:
                try:
                    self._connect(deadline)
                except (TransportError, OSError) as e:
                    raise StoreUnreachable(f"control plane: cannot reconnect to {where}: {e}") from e
                self.reconnects += 1
            assert self.sock is not None and self.ch is not None
            try:
                self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                self.ch.send(_pack_req(op, key, value))
                self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                got = self.ch.recv(self.max_value_bytes + 1, too_big)
            except socket.timeout as e:
                self._drop()
                raise StoreUnreachable(f"control plane: no answer from {where} within {limit:.1f} s") from e
            except (OSError, ConnectionError) as e:
                self._drop()
                raise StoreUnreachable(f"control plane: lost {where}: {e}") from e
        finally:
            self.lock.release()
        if got[:1] == ERR:
            raise ConfigError(f"control plane: store refused the request for key {key!r}: "
                              f"{got[1:].decode(errors='replace')}")
        return got[:1], got[1:]

    def close(self, bye: bool = False) -> None:
        """Close the connection; ``bye``: first cancel its on-close keys (a clean exit, not a death)."""
        if bye and self.sock is not None:
            try:
                self.request(BYE, "", timeout_s=1.0)
            except (TransportError, ConfigError):
                pass
        with self.lock:
            self._drop()
