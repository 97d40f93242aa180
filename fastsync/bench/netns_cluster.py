"""A cluster on one machine: hosts as Linux network namespaces, each with one shaped NIC.

Every figure that is about a cluster (all-to-all against the rank-0 funnel, relays, deltas, peer
reload) depends on the NIC being the bottleneck, which one host's loopback never shows. This rig
builds H "hosts" as network namespaces joined through a bridge that lives in a namespace of its
own (so nothing is added to, or changed in, the namespace the rig was started from), gives each
host one NIC (``nic0``, a veth) shaped to ``nic_gbps`` in both directions (``tbf``: the host's
egress on its end, its ingress on the bridge's end), with optional loss and one-way latency, and
runs processes inside a host. Loss (and a cut, which is 100 % loss) is a classic-BPF filter that
sends packets at random to a class that drops them: it needs only ``htb``, ``pfifo`` and
``cls_bpf``, which minimal kernels have. Loss counts the packets the qdisc sees, which on a veth
are GSO segments of up to 64 KiB, not 1500-byte frames (with GSO off, this VM's CPU caps a veth
at ~45 MB/s). Latency needs ``netem``. This project's VMs (kernel 6.18) have neither ``netem``
(``CONFIG_NET_SCH_NETEM is not set``) nor the ``fq`` qdisc (``CONFIG_NET_SCH_FQ is not set``), so
no delay by earliest-departure-time stamps from BPF either; there a rig with ``latency_ms > 0`` is
refused, naming the missing qdisc.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544) and exist only inside the
namespaces the rig made; host ``i`` is ``198.18.0.{i+1}``. Names carry the owner's pid
(``fsrig<pid>-h<i>``, ``fsrig<pid>-sw``). Teardown removes the namespaces (their veths and qdiscs
go with them) and kills what the rig started in them; a guardian process (its own session, so a
killed process group does not take it down) does the same when the owner dies without cleaning
up, and :func:`~fastsync.bench.netns.sweep_stale` removes rigs whose owner pid is gone. Nothing else is touched.

On one kernel, UCX reaches a process in another namespace through shared memory and CMA unless it
is held to TCP, so processes run with ``UCX_TLS=tcp,self`` (checked: a sync then crosses the
veth at the link's rate; without it only control traffic does), ``FASTSYNC_NET_DEVICES=nic0``
and ``GLOO_SOCKET_IFNAME=nic0``. Processes on one host reach each other over TCP on ``nic0``'s
address as well (the kernel keeps that traffic local): a GPU host would use NVLink or CUDA IPC.

Example::

    with HostRig(2, nic_gbps=2.0, latency_ms=0.1) as rig:
        with rig.entered(0):                  # sockets made here live on host 0
            store = TCPStoreControl.server(host=rig.addr(0))
        p = rig.popen(1, [sys.executable, "engine.py", rig.addr(0)])
        rig.cut(1); ...; rig.restore(1)
        tx, rx = rig.nic_bytes(1)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastsync.bench import netns
from fastsync.errors import ConfigError

__all__ = ["HostRig", "Host", "MAX_HOSTS", "MAX_NIC_GBPS", "NO_DELAY_QDISC", "check_shape", "netem_available", "host_env"]

NIC = "nic0"
SUBNET = "198.18.0"
MAX_HOSTS = 64
MAX_NIC_GBPS = 400.0  # tbf on a veth is CPU-bound far below this; larger values are a typo


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise ConfigError(f"host rig: tc {' '.join(args)} in namespace {ns} failed: {r.stderr.strip()}")


_NETEM: list[bool] = []


#: why a kernel without netem cannot delay packets another way either (the refusals say it)
NO_DELAY_QDISC = ("which this kernel does not have (CONFIG_NET_SCH_NETEM is not set); nor does it have the 'fq' "
                  "qdisc (CONFIG_NET_SCH_FQ is not set), so no delay by departure-time stamps from BPF either")


def netem_available() -> bool:
    """Whether this kernel has the ``netem`` qdisc (latency); probed once in a scratch namespace."""
    if not _NETEM:
        probe = f"{netns.PREFIX}{os.getpid()}-netem"
        ok = False
        if netns.ip("netns", "add", probe, check=False).returncode == 0:
            r = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                               capture_output=True, timeout=30)
            ok = r.returncode == 0
            netns.ip("netns", "delete", probe, check=False)
        _NETEM.append(ok)
    return _NETEM[0]


def check_shape(num_hosts: int, nic_gbps: float, latency_ms: float = 0.0, loss_pct: float = 0.0) -> None:
    """ConfigError naming the parameter when a rig shape is not buildable or not meaningful."""
    if not isinstance(num_hosts, int) or not 1 <= num_hosts <= MAX_HOSTS:
        raise ConfigError(f"host rig: hosts must be an integer in 1..{MAX_HOSTS}, got {num_hosts!r}")
    if not (isinstance(nic_gbps, (int, float)) and 0.001 <= nic_gbps <= MAX_NIC_GBPS):
        raise ConfigError(f"host rig: nic_gbps must be in 0.001..{MAX_NIC_GBPS:g} (Gb/s), got {nic_gbps!r}")
    if not (isinstance(latency_ms, (int, float)) and 0 <= latency_ms <= 10_000):
        raise ConfigError(f"host rig: latency_ms must be in 0..10000, got {latency_ms!r}")
    if not (isinstance(loss_pct, (int, float)) and 0 <= loss_pct <= 100):
        raise ConfigError(f"host rig: loss_pct must be in 0..100, got {loss_pct!r}")


@dataclass(frozen=True, slots=True)
class Host:
    index: int
    ns: str
    addr: str
    nic: str = NIC


def host_env(host: Host, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a process on ``host``: NIXL/UCX held to TCP on its NIC, gloo on its NIC."""
    env = dict(os.environ if base is None else base)
    env.update({"FASTSYNC_NET_DEVICES": host.nic, "UCX_NET_DEVICES": host.nic, "UCX_TLS": "tcp,self",
                "GLOO_SOCKET_IFNAME": host.nic, "FASTSYNC_HOST_ADDR": host.addr})
    return env


class HostRig:
    """``num_hosts`` hosts on one bridge, each NIC shaped to ``nic_gbps`` (both directions).

    ``latency_ms``: one-way delay added on each host's egress (host to host: ``latency_ms``;
    round trip ``2 * latency_ms``). ``loss_pct``: random loss on each host's egress.
    ``queue_ms``: the NIC queue's depth in time at line rate (``tbf latency``; default 200 ms).
    """

    def __init__(self, num_hosts: int, nic_gbps: float, latency_ms: float = 0.0, loss_pct: float = 0.0, *,
                 guard: bool = True, queue_ms: float = 200.0) -> None:
        check_shape(num_hosts, nic_gbps, latency_ms, loss_pct)
        if not 1.0 <= queue_ms <= 1000.0:
            raise ConfigError(f"host rig: queue_ms (the NIC queue, in ms of line rate) must be in [1, 1000], got {queue_ms}")
        self.queue_ms = float(queue_ms)
        why = netns.rig_unavailable()
        if why is not None:
            raise ConfigError(f"host rig: {why}")
        if latency_ms and not netem_available():
            raise ConfigError(f"host rig: latency_ms needs the 'netem' qdisc (sch_netem), {NO_DELAY_QDISC}; run with "
                              "latency_ms=0 (--latency-ms 0) or on a kernel with netem")
        netns.sweep_stale()
        self.nic_gbps, self.latency_ms, self.loss_pct = float(nic_gbps), float(latency_ms), float(loss_pct)
        self.owner = os.getpid()
        self.tag = f"{netns.PREFIX}{self.owner}-{os.urandom(2).hex()}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [Host(i, f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}") for i in range(num_hosts)]
        self._procs: list[subprocess.Popen] = []
        self._guard: subprocess.Popen | None = None
        self._closed = False
        self._lock = threading.Lock()
        try:
            if guard:
                self._start_guard()
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- building ------------------------------------------------------------------------
    def _start_guard(self) -> None:
        """A process in its own session that removes this rig when our end of its stdin closes
        (we exited, cleanly or not) and the rig is still there."""
        code = ("import sys; sys.stdin.read(); from fastsync.bench.netns import namespaces, remove_namespaces; "
                f"remove_namespaces([n for n in namespaces() if n.startswith({self.tag + '-'!r})])")
        self._guard = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                       env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})

    def _build(self) -> None:
        sw = self.switch
        netns.ip("netns", "add", sw)
        netns.ip("-n", sw, "link", "add", "br0", "type", "bridge")
        netns.ip("-n", sw, "link", "set", "br0", "up")
        netns.ip("-n", sw, "link", "set", "lo", "up")
        for h in self.hosts:
            netns.ip("netns", "add", h.ns)
            port = f"p{h.index}"
            # both ends are created inside the rig's namespaces: nothing appears in the caller's
            netns.ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", h.nic, "netns", h.ns)
            netns.ip("-n", sw, "link", "set", port, "master", "br0")
            netns.ip("-n", sw, "link", "set", port, "up")
            netns.ip("-n", h.ns, "link", "set", "lo", "up")
            netns.ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.nic)
            netns.ip("-n", h.ns, "link", "set", h.nic, "up")
            self._shape(h.ns, h.nic, self.latency_ms, self.loss_pct)  # host -> switch
            self._shape(sw, port, 0.0, self.loss_pct)  # switch -> host: the NIC's receive side
        self._wait_links()

    def _tbf_args(self) -> list[str]:
        rate_bps = self.nic_gbps * 1e9
        burst = max(64 << 10, int(rate_bps / 8 * 0.002))  # ~2 ms of line rate, at least 64 KiB
        # queue_ms: how long a packet may wait in the NIC's queue (tbf drops beyond it); 200 ms is
        # deep, a real NIC's transmit queue holds a few ms
        return ["tbf", "rate", f"{rate_bps / 1e6:.3f}mbit", "burst", str(burst), "latency", f"{self.queue_ms:g}ms"]

    def _shape(self, ns: str, dev: str, latency_ms: float, loss_pct: float) -> None:
        """``tbf`` at the NIC rate as root; under it an ``htb`` with a pass class and a drop class
        (a ``pfifo`` of length 0) that a classic-BPF filter feeds at random for loss, or always for
        a cut; under the pass class ``netem`` for latency where the kernel has it."""
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *self._tbf_args())
        _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "2:", "htb", "default", "10", "r2q", "1000")
        _tc(ns, "class", "add", "dev", dev, "parent", "2:", "classid", "2:10", "htb", "rate", "100gbit",
            "ceil", "100gbit", "burst", "500000", "cburst", "500000")
        _tc(ns, "class", "add", "dev", dev, "parent", "2:", "classid", "2:20", "htb", "rate", "8kbit", "ceil", "8kbit")
        _tc(ns, "qdisc", "add", "dev", dev, "parent", "2:20", "handle", "20:", "pfifo", "limit", "0")
        if latency_ms:
            _tc(ns, "qdisc", "add", "dev", dev, "parent", "2:10", "handle", "10:", "netem", "limit", "100000",
                "delay", f"{latency_ms:.3f}ms")
        self._set_loss(ns, dev, loss_pct)

    @staticmethod
    def _set_loss(ns: str, dev: str, loss_pct: float) -> None:
        """Send ``loss_pct`` % of the packets the qdisc sees to the drop class (classic BPF: load
        the kernel's per-packet random number, compare with a threshold)."""
        subprocess.run(["tc", "-n", ns, "filter", "del", "dev", dev, "parent", "2:", "prio", "1"],
                       capture_output=True, timeout=30)  # none yet: fine
        if loss_pct <= 0:
            return
        if loss_pct >= 100:
            code = "1,6 0 0 4294967295"  # ret -1: every packet to the drop class
        else:
            threshold = min(int(loss_pct / 100 * 2**32), 2**32 - 1)
            code = f"4,32 0 0 4294963256,53 1 0 {threshold},6 0 0 4294967295,6 0 0 0"  # ld rand; jge T
        _tc(ns, "filter", "add", "dev", dev, "parent", "2:", "prio", "1", "bpf", "bytecode", code, "classid", "2:20")

    def _wait_links(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for h in self.hosts:
            while True:
                out = netns.ip("-n", h.ns, "-j", "link", "show", "dev", h.nic).stdout
                if json.loads(out)[0].get("operstate") in ("UP", "UNKNOWN"):
                    break
                if time.monotonic() > deadline:
                    raise ConfigError(f"host rig: {h.nic} of host {h.index} did not come up within {timeout_s} s")
                time.sleep(0.05)

    # ---- using ---------------------------------------------------------------------------
    def addr(self, i: int) -> str:
        return self.hosts[i].addr

    def env(self, i: int, base: dict[str, str] | None = None) -> dict[str, str]:
        return host_env(self.hosts[i], base)

    @contextlib.contextmanager
    def entered(self, i: int) -> Iterator[Host]:
        """Run the block with this thread in host ``i``'s namespace: sockets made inside stay
        there (a listening store keeps serving host ``i`` after the block)."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            netns.setns(f"/run/netns/{self.hosts[i].ns}")
            yield self.hosts[i]
        finally:
            try:
                netns.setns(f"/proc/self/fd/{own}")
            finally:
                os.close(own)

    def popen(self, i: int, cmd: Sequence[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        """Start ``cmd`` on host ``i`` (killed at :meth:`close` if still running)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[i].ns, *cmd], env=self.env(i, env), **kw)
        with self._lock:
            self._procs.append(p)
        return p

    def run(self, i: int, cmd: Sequence[str], timeout_s: float = 60.0, **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.hosts[i].ns, *cmd], env=self.env(i, kw.pop("env", None)),
                              capture_output=True, text=True, timeout=timeout_s, **kw)

    def nic_bytes(self, i: int) -> tuple[int, int]:
        """``(tx_bytes, rx_bytes)`` counted on host ``i``'s NIC since it was made."""
        out = json.loads(netns.ip("-n", self.hosts[i].ns, "-s", "-j", "link", "show", "dev", NIC).stdout)[0]
        stats = out["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def _both_ends(self, i: int) -> list[tuple[str, str]]:
        h = self.hosts[i]
        return [(h.ns, h.nic), (self.switch, f"p{h.index}")]

    def degrade(self, i: int, *, loss_pct: float) -> None:
        """Drop ``loss_pct`` % of host ``i``'s packets, both directions (100: a cut)."""
        check_shape(1, self.nic_gbps, 0.0, loss_pct)
        for ns, dev in self._both_ends(i):
            self._set_loss(ns, dev, loss_pct)

    def cut(self, i: int) -> None:
        """Drop every packet to and from host ``i`` (a pulled cable: sockets stay open, nothing
        arrives; TCP retransmits until :meth:`restore`)."""
        self.degrade(i, loss_pct=100.0)

    def restore(self, i: int) -> None:
        """Back to the rig's own latency and loss."""
        self.degrade(i, loss_pct=self.loss_pct)

    def set_rate(self, gbps: float) -> None:
        """Reshape every NIC to ``gbps`` (calibration probes lift the limit, then put it back)."""
        self.nic_gbps = float(gbps)
        for h in self.hosts:
            for ns, dev in self._both_ends(h.index):
                _tc(ns, "qdisc", "change", "dev", dev, "root", "handle", "1:", *self._tbf_args())

    def start_ray(self, temp_dir: str, port: int = 6380, num_cpus: int = 2,
                  env: dict[str, str] | None = None, timeout_s: float = 180.0, num_gpus: int = 0) -> str:
        """A real multi-node Ray cluster on the rig: the head on host 0, a worker node on every
        other host, each bound to its host's address, with a custom resource ``fs_host{i}`` to pin
        actors to host ``i``, and the host's environment (NIC, NIXL held to TCP, gloo's interface)
        inherited by every worker process Ray starts there. Returns the address for
        ``ray.init``. ``num_gpus``: logical GPUs per node (OpenRLHF places engines by them). Ray shells out here (``ray start``): fastsync itself does not import Ray. The
        nodes go with the rig (:meth:`close` kills what runs inside its namespaces); nothing is
        started in, or reached from, the caller's namespace (the hosts have no route out, so Ray's
        probe of a public resolver for its own address fails at once, locally)."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        head = f"{self.addr(0)}:{port}"
        for h in self.hosts:
            args = [ray, "start", f"--node-ip-address={h.addr}", f"--num-cpus={num_cpus}",
                    f"--temp-dir={os.path.join(temp_dir, f'h{h.index}')}", f'--resources={{"fs_host{h.index}": 100}}',
                    "--disable-usage-stats"] + ([f"--num-gpus={num_gpus}"] if num_gpus else [])
            args += (["--head", f"--port={port}", "--include-dashboard=false"] if h.index == 0 else [f"--address={head}"])
            r = self.run(h.index, args, timeout_s=timeout_s, env={**os.environ, **(env or {}), "RAY_AUTH_MODE": "disabled"})
            if r.returncode:
                raise ConfigError(f"host rig: ray start on host {h.index} failed: {r.stderr[-1500:]}")
        return head

    def enter_for_good(self, i: int) -> None:
        """Move this whole process (its calling thread, and threads it starts later) into host
        ``i``'s namespace, e.g. a Ray driver that must reach the rig's addresses. Call before the
        process starts threads that need the network."""
        netns.setns(f"/run/netns/{self.hosts[i].ns}")

    def names(self) -> list[str]:
        return [self.switch] + [h.ns for h in self.hosts]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=10)
        netns.remove_namespaces([n for n in netns.namespaces() if n.startswith(self.tag + "-")])
        if self._guard is not None:
            with contextlib.suppress(Exception):
                self._guard.stdin.close()  # the guardian finds nothing left and exits
                self._guard.wait(timeout=10)

    def __enter__(self) -> "HostRig":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - a forgotten rig still goes away
        with contextlib.suppress(Exception):
            self.close()
