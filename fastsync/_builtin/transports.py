"""Built-in plugin: transports. Registered through the `fastsync` entry-point group like any plugin.

``nixl`` (one-sided WRITE, the default where NIXL imports), ``torch`` (isend/irecv over
torch.distributed) and ``rank0`` (gather to trainer rank 0 + broadcast: the host frameworks'
baseline). Each says whether it can run here and what to install when it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastsync.hookspecs import hookimpl


def _nixl(**options: Any) -> Any:
    from fastsync.transport.nixl import NixlTransport

    return NixlTransport(**options)


def _torch(**options: Any) -> Any:
    from fastsync.transport.torch_p2p import TorchP2PTransport

    return TorchP2PTransport(**options)


def _rank0(**options: Any) -> Any:
    from fastsync.transport.rank0 import Rank0Transport

    return Rank0Transport(**options)


@hookimpl
def fastsync_register_transports(register: Callable[..., None]) -> None:
    from fastsync.transport import availability

    for name, factory in (("nixl", _nixl), ("torch", _torch), ("rank0", _rank0)):
        ok, why = availability(name)
        # what plans it runs: replicas planned once (fanout), and relays between engine ranks
        register(name, factory, available=ok, why=why, fanout=name != "rank0", relays=name == "nixl")
