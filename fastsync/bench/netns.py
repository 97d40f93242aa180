"""Linux network namespaces, the primitives the host rig (``bench/netns_cluster.py``) is built from:
``ip`` run in one, which namespaces exist and whether their owner pid lives (:func:`sweep_stale`
removes rigs whose owner died), removing namespaces with every process inside, and moving a process
or thread into one (``setns``, with a sysfs of its own as ``ip netns exec`` gives:
:func:`run_in_host`). Names carry the owner's pid: ``<PREFIX><pid>-...``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PREFIX", "ip", "rig_unavailable", "pid_alive", "namespaces", "remove_namespaces", "sweep_stale", "setns",
           "own_sysfs", "run_in_host"]

PREFIX = "fsrig"
_CLONE_NEWNET = 0x40000000


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def rig_unavailable() -> str | None:
    """Why no rig can be built here (a sentence naming what is missing), or None when it can."""
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"'{tool}' (iproute2) is not installed"
    if not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = ip("netns", "add", probe, check=False)
    if r.returncode:
        return f"cannot create network namespaces (needs CAP_NET_ADMIN, e.g. root): {r.stderr.strip()}"
    ip("netns", "delete", probe, check=False)
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def remove_namespaces(names: Sequence[str]) -> None:
    """Kill every process inside ``names`` and delete the namespaces (veths and qdiscs go too)."""
    for ns in names:
        pids = [p for p in ip("netns", "pids", ns, check=False).stdout.split() if p != str(os.getpid())]
        for pid in pids:  # never this process: a Ray driver may have moved into a host (enter_for_good)
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
    for ns in names:
        ip("netns", "delete", ns, check=False)


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Remove rigs left by owners that died (names ``<prefix><pid>-...`` whose pid is gone);
    returns the namespaces removed. Rigs of live owners, and every other namespace, are kept."""
    stale = []
    for ns in namespaces():
        m = re.match(rf"^{re.escape(prefix)}(\d+)-", ns)
        if m and not pid_alive(int(m.group(1))):
            stale.append(ns)
    remove_namespaces(stale)
    return stale


_libc: Any = None


def setns(path: str) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def own_sysfs() -> None:
    """A private mount namespace with a sysfs of this process's network namespace (what ``ip
    netns exec`` does): UCX finds network devices under ``/sys/class/net``, which otherwise
    still lists the devices of the namespace the process came from."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    if libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None) != 0:  # our mounts never leave this process
        raise OSError(ctypes.get_errno(), "making / a slave mount failed")
    libc.umount2(b"/sys", _MNT_DETACH)
    if libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(ctypes.get_errno(), "mounting sysfs for the host's network namespace failed")


def run_in_host(ns: str, env: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """A process entry point (e.g. a ``multiprocessing`` target) that first moves this process into
    the network namespace ``ns`` (with a sysfs of its own, as ``ip netns exec`` gives) and takes
    ``env``, then calls ``target(*args)``. Call it before any thread or socket exists in the
    process: threads started later inherit the namespace."""
    setns(f"/run/netns/{ns}")
    own_sysfs()
    os.environ.update(env)
    return target(*args)
