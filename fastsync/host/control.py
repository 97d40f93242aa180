"""The job's control plane as a host framework sets it up: one rank serves fastsync's store, the
others join it with the address and the job secret carried over the host's own channel.

verl carries the address in ``prepare``'s metadata (Ray), OpenRLHF over DeepSpeed's process
group; both use these four functions, so the store binds where the host says, the secret never
crosses fastsync's own wire, and a client is never opened to the process's own server::

    server = open_control(host=node_address())          # the serving rank
    address = control_address(server)                   # [host, port, secret hex], via the host
    ctl = join_control(address, server=server)          # every rank (the server itself reused)
    ctl = share_over_torch(rank, host=..., timeout_s=)  # or: rank 0 serves, torch.distributed carries it
"""

from __future__ import annotations

from typing import Any

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.errors import ConfigError

__all__ = ["node_address", "open_control", "control_address", "join_control", "share_over_torch"]


def node_address() -> str:
    """This node's address for a store the job's other nodes must reach: Ray's node IP when Ray
    is initialized in this process, else loopback (a single-host job). Never a wildcard."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - no Ray (or not started): a single-host run
        pass
    return DEFAULT_HOST


def open_control(*, host: str | None = None, port: int = 0, timeout_s: float = 120.0) -> TCPStoreControl:
    """Serve the job's control store on ``host`` (default :func:`node_address`), ``port`` 0 = free."""
    if timeout_s <= 0:
        raise ConfigError(f"control plane timeout_s must be positive, got {timeout_s}")
    return TCPStoreControl.server(port=port, host=host if host is not None else node_address(), timeout_s=timeout_s)


def control_address(server: TCPStoreControl) -> list[Any]:
    """``[host, port, job secret hex]``: what the host framework carries to the other ranks."""
    return [server.host, server.port, server.secret.hex()]


def join_control(address: list[Any] | tuple[Any, ...], *, timeout_s: float = 120.0,
                 server: TCPStoreControl | None = None) -> TCPStoreControl:
    """A client of the store at ``address`` (from :func:`control_address`); ``server`` when it is
    this process's own store (no second connection to itself). ConfigError naming the shape."""
    if not isinstance(address, (list, tuple)) or len(address) != 3:
        raise ConfigError(f"control address must be [host, port, job secret], got {address!r:.80}")
    host, port, secret = address
    if server is not None and (host, int(port)) == (server.host, server.port):
        return server
    return TCPStoreControl.client(port=int(port), host=str(host), timeout_s=timeout_s, secret=secret)


def share_over_torch(rank: int, *, host: str, timeout_s: float = 120.0) -> TCPStoreControl:
    """Collective over the default ``torch.distributed`` group: rank 0 serves the store on
    ``host``, its port and the job secret reach the other ranks by ``broadcast_object_list``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("share_over_torch needs an initialized torch.distributed group")
    server = open_control(host=host, timeout_s=timeout_s) if rank == 0 else None
    box = control_address(server) if server is not None else [None, None, None]
    dist.broadcast_object_list(box, src=0)
    return join_control(box, timeout_s=timeout_s, server=server)
