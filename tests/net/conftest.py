"""The host rig for tests: hosts as network namespaces the test makes and removes (see
``fastsync.bench.netns_cluster``). Tests skip, saying why, where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from fastsync.bench.netns import rig_unavailable
from fastsync.bench.netns_cluster import HostRig


@pytest.fixture
def host_rig() -> Iterator[Callable[..., HostRig]]:
    """``host_rig(num_hosts, nic_gbps, ...)``: a rig that is torn down after the test (and by its
    guardian process if the test is killed)."""
    why = rig_unavailable()
    if why is not None:
        pytest.skip(f"no host rig here: {why}")
    made: list[HostRig] = []

    def make(*args: object, **kw: object) -> HostRig:
        rig = HostRig(*args, **kw)  # type: ignore[arg-type]
        made.append(rig)
        return rig

    try:
        yield make
    finally:
        for rig in made:
            rig.close()
