"""The job secret, the keys derived from it, and where listeners bind.

Every process of one sync job shares one secret. It comes, in this order, from an explicit
argument (the host framework hands it over), the ``FASTSYNC_JOB_SECRET`` environment variable,
or (on the process that starts the control store only) a fresh random one, which is then put in
this process's environment so the processes it spawns inherit it; other hosts get it through the
host framework's own channel (Ray, verl's metadata, the engine's RPC), never through fastsync's
network. Separate keys are derived from it (HKDF-SHA256) for the control store's handshake and
session, NIXL notifications and engine-host requests, so no key serves two purposes.

Listeners bind to the configured interface only: the control store to the ``host`` it is given
(127.0.0.1 by default), NIXL/UCX to the devices in ``FASTSYNC_NET_DEVICES`` (``lo`` by default,
passed to UCX as ``UCX_NET_DEVICES``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from fastsync.errors import ConfigError

__all__ = ["SECRET_ENV", "NET_DEVICES_ENV", "DEFAULT_NET_DEVICES", "job_secret", "derive_key", "mac", "check_mac",
           "net_devices", "loopback_mismatch"]

SECRET_ENV = "FASTSYNC_JOB_SECRET"
NET_DEVICES_ENV = "FASTSYNC_NET_DEVICES"
DEFAULT_NET_DEVICES = "lo"
MIN_SECRET_BYTES = 16


def _parse(secret: bytes | str, where: str) -> bytes:
    if isinstance(secret, str):
        try:
            raw = bytes.fromhex(secret)
        except ValueError:
            raw = secret.encode()
    else:
        raw = bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(f"job secret from {where} is {len(raw)} bytes; at least {MIN_SECRET_BYTES} are needed "
                          f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return raw


def job_secret(secret: bytes | str | None = None, *, create: bool = False) -> bytes:
    """The job secret: ``secret`` if given, else ``$FASTSYNC_JOB_SECRET``, else (``create=True``,
    the store's own process) a new random one exported to ``$FASTSYNC_JOB_SECRET`` for children.
    ConfigError when there is none to be had."""
    if secret is not None:
        return _parse(secret, "the secret= argument")
    env = os.environ.get(SECRET_ENV)
    if env:
        return _parse(env, f"${SECRET_ENV}")
    if not create:
        raise ConfigError(f"no job secret: pass secret= (from the process that started the control store) "
                          f"or set ${SECRET_ENV}")
    raw = secrets.token_bytes(32)
    os.environ[SECRET_ENV] = raw.hex()  # inherited by processes spawned from here on
    return raw


def derive_key(secret: bytes, purpose: str, salt: bytes = b"fastsync-v1") -> bytes:
    """A 32-byte key for one ``purpose`` (HKDF-SHA256)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=purpose.encode()).derive(secret)


def mac(key: bytes, *parts: bytes | str, size: int = 16) -> bytes:
    """HMAC-SHA256 over ``parts`` (each length-prefixed, so no two splits collide), truncated."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(4, "big"))
        h.update(b)
    return h.digest()[:size]


def check_mac(key: bytes, tag: bytes, *parts: bytes | str) -> bool:
    return hmac.compare_digest(tag, mac(key, *parts, size=len(tag))) if tag else False


def net_devices(devices: str | None = None) -> str:
    """UCX network devices NIXL may listen and connect on: ``devices``, else
    ``$FASTSYNC_NET_DEVICES``, else ``lo`` (loopback only)."""
    got = devices if devices is not None else os.environ.get(NET_DEVICES_ENV, DEFAULT_NET_DEVICES)
    if not got or not got.strip():
        raise ConfigError(f"net devices must name at least one interface (e.g. 'lo', 'eth0', 'mlx5_0:1'), got {got!r}")
    return got.strip()


def loopback_mismatch(devices: str, control_host: str | None) -> str | None:
    """A warning when NIXL/UCX may use only loopback (``devices`` is ``lo``, the default) while
    the control store is reached at a non-loopback address, i.e. probably a job spanning hosts
    that forgot ``FASTSYNC_NET_DEVICES``; None otherwise. (A one-host job may give the store its
    cluster address too, so this warns rather than refuses.)"""
    import ipaddress

    if devices.strip() != DEFAULT_NET_DEVICES or not control_host:
        return None
    host = control_host.strip("[]")
    if host in ("localhost", "localhost.localdomain"):
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: not known to be loopback
    return (f"the control store is at {control_host} but NIXL/UCX may use only '{DEFAULT_NET_DEVICES}' "
            f"(${NET_DEVICES_ENV} is unset or 'lo'): engines or trainers on other hosts cannot be reached; "
            f"set {NET_DEVICES_ENV} on every process to the cluster interfaces, e.g. 'mlx5_0:1,eth0'")
