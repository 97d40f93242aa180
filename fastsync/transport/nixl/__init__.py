"""The NIXL transport: one-sided RDMA WRITEs (UCX) from trainer ranks into engine ranks' registered
memory, and what shares its wire.

* :mod:`.transport`: :class:`NixlTransport`, dense syncs (set-up, pipelined writes, notifications);
* :mod:`.relay`, :mod:`.chain`: relays down chains of replicas (dense units);
* :mod:`.delta`, :mod:`.delta_relay`: delta streams into inboxes, and forwarded down chains;
* :mod:`.notes`: the one notification codec (``kind|version|src|a|b|mac``);
* :mod:`.writes`: prepared writes, settled and reconnected after a failed version;
* :mod:`.teardown`: quiesce posted writes, release handles, registrations and remotes.
"""

from __future__ import annotations

from fastsync.transport.nixl.transport import IMPORT_ERROR, NixlTransport, warm_up

__all__ = ["NixlTransport", "IMPORT_ERROR", "warm_up"]
