"""Which syncs of ``fastsync bench`` are timed, and the test-only fault hook that fails one.

``FASTSYNC_BENCH_FAIL_SYNC=<transport>:<k>`` (test-only: read by the bench's engine worker
processes, nowhere else) makes engine rank 0 refuse the ``k``-th timed sync (1-based) of that
transport after its writes landed: it rolls the version back and reports the sync as failed, as
a real verification or apply failure would. The bench must then count it, print it and exit
non-zero (``tests/bench/test_bench_failures.py``).
"""

from __future__ import annotations

import os

from fastsync.errors import ConfigError

__all__ = ["FAIL_SYNC_ENV", "timed_versions", "fail_version"]

#: Test-only: ``<transport>:<k>`` fails the k-th timed sync (1-based) of that transport.
FAIL_SYNC_ENV = "FASTSYNC_BENCH_FAIL_SYNC"


def timed_versions(schedule: list[tuple[str, int, bool]], warmup: int) -> dict[str, list[int]]:
    """Per transport, the versions of its timed syncs in run order: its entries of ``schedule``
    after its first ``warmup``, leaving out the checksum-verified ones (``verify`` True)."""
    seen: dict[str, int] = {}
    out: dict[str, list[int]] = {}
    for name, version, verify in schedule:
        i = seen.get(name, 0)
        seen[name] = i + 1
        out.setdefault(name, [])
        if i >= warmup and not verify:
            out[name].append(version)
    return out


def fail_version(schedule: list[tuple[str, int, bool]], warmup: int, spec: str | None = None) -> int | None:
    """The version the fault hook fails (``spec``, default the environment's
    :data:`FAIL_SYNC_ENV`), or None when the hook is unset. ConfigError naming the variable for a
    malformed value or a transport / index the schedule does not have."""
    spec = os.environ.get(FAIL_SYNC_ENV) if spec is None else spec
    if not spec:
        return None
    name, sep, k = spec.rpartition(":")
    if not sep or not name or not k.strip().isdigit() or int(k) < 1:
        raise ConfigError(f"{FAIL_SYNC_ENV}={spec!r}: expected <transport>:<k>, k the 1-based timed sync, e.g. nixl:2")
    timed = timed_versions(schedule, warmup)
    if name not in timed:
        raise ConfigError(f"{FAIL_SYNC_ENV}={spec!r}: transport {name!r} is not in this run ({sorted(timed)})")
    if int(k) > len(timed[name]):
        raise ConfigError(f"{FAIL_SYNC_ENV}={spec!r}: {name} has {len(timed[name])} timed syncs")
    return timed[name][int(k) - 1]
