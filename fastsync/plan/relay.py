"""Relay-aware fan-out: how identical replicas get the first replica's transfers.

Writing every replica straight from the trainer makes a trainer rank send its shard once per
replica (Qwen3-30B-A3B from ``fsdp:64`` into 192 tp1 engines: 183 GB per trainer rank, for 61 GB
each engine needs). The alternatives, per transfer:

* **direct**: the trainer rank writes copy ``k`` itself;
* **relay**: engine rank ``j`` of replica ``p`` forwards the copy it received to engine rank ``j``
  of replica ``k`` (a WRITE from its registered memory, after the copy landed). Each relaying rank
  forwards to one replica, so its egress never exceeds its ingress, which the layout fixes.

:func:`choose_fanout` picks, from the cost model below, ``D`` replicas fed by trainers (the roots;
replica ``k >= D`` is relayed from ``k - D``: ``D`` pipelined chains of ``ceil(R / D)``), then sends
straight to every replica each transfer whose trainer rank has room for it under the busiest port.

Cost model (bytes at one NIC's rate; the simulator, ``plan/simulate.py``, uses the same one):
``max(busiest trainer egress, busiest engine ingress) + hops * (largest relayed transfer + 64 KiB)``
where ``hops = ceil(R / D) - 1`` is the depth of the longest chain: a relayed transfer cannot leave
before it arrived, so each hop delays the last one by its own size (store-and-forward per transfer,
pipelined across transfers). ``mode``: ``auto`` (this model), ``direct`` (every replica from the
trainer, the old scheme, with flat planning cost), ``chain`` (one root: each byte leaves its trainer
rank once; the least trainer egress, the longest chain). Pure Python, no transport imports.
"""

from __future__ import annotations

from fastsync.errors import ConfigError
from fastsync.plan.types import Fanout, Transfer

__all__ = ["FANOUT_MODES", "HOP_OVERHEAD_BYTES", "choose_fanout", "chain_parents"]

FANOUT_MODES = ("off", "direct", "auto", "chain")
#: Per-hop cost besides the transfer's bytes, in bytes at line rate (~ posting + notification, 1.3 us at 50 GB/s).
HOP_OVERHEAD_BYTES = 64 << 10


def chain_parents(replicas: int, roots: int) -> tuple[int, ...]:
    """``roots`` chains: replica ``k < roots`` is fed by trainers, ``k >= roots`` by ``k - roots``."""
    return tuple(-1 if k < roots else k - roots for k in range(replicas))


def choose_fanout(transfers: list[Transfer], num_trainers: int, replica_size: int, replicas: int,
                  mode: str = "auto") -> Fanout:
    """The fan-out of ``transfers`` (planned for replica 0) over ``replicas`` replicas; see the module
    docstring."""
    if mode not in FANOUT_MODES or mode == "off":
        raise ConfigError(f"fanout mode must be one of {FANOUT_MODES[1:]}, got {mode!r}")
    if replicas < 1 or replica_size < 1:
        raise ConfigError(f"replicas ({replicas}) and replica_size ({replica_size}) must be positive")
    if mode == "direct" or replicas == 1:
        return Fanout(replica_size, replicas, chain_parents(replicas, replicas))
    send = [0] * num_trainers
    recv = [0] * replica_size
    biggest = 0
    for t in transfers:
        send[t.src_rank] += t.nbytes
        recv[t.dst_rank] += t.nbytes
        biggest = max(biggest, t.nbytes)
    max_send, max_recv = max(send, default=0), max(recv, default=0)
    hop = biggest + HOP_OVERHEAD_BYTES
    if mode == "chain":
        roots = 1
    else:
        def cost(d: int) -> tuple[int, int]:  # (time in bytes, trainer egress): least egress among equals
            return max(d * max_send, max_recv) + (-(-replicas // d) - 1) * hop, d
        # chain length ceil(R/D) only changes at D = ceil(R/L): try those (and the extremes)
        cands = {1, replicas} | {-(-replicas // n) for n in range(1, replicas + 1)}
        roots = min(sorted(cands), key=cost)
    parents = chain_parents(replicas, roots)
    if mode == "chain" or roots == replicas:
        return Fanout(replica_size, replicas, parents)
    # mix: a transfer goes straight to every replica when its trainer rank has room under the busiest port
    budget = max(roots * max_send, max_recv)
    load = [roots * s for s in send]
    extra = replicas - roots
    direct = []
    for i, t in enumerate(transfers):
        add = extra * t.nbytes
        if load[t.src_rank] + add <= budget:
            load[t.src_rank] += add
            direct.append(i)
    if len(direct) == len(transfers):
        return Fanout(replica_size, replicas, chain_parents(replicas, replicas))
    return Fanout(replica_size, replicas, parents, tuple(direct))
