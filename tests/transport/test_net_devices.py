"""FASTSYNC_NET_DEVICES defaults to loopback: a job whose control store sits at a cluster address
but left NIXL/UCX on 'lo' gets a warning naming the variable (cross-host writes could not leave
the host); loopback stores, explicit devices and host names that are loopback stay quiet."""

from __future__ import annotations

import pytest

from fastsync.errors import ConfigError
from fastsync.security import loopback_mismatch, net_devices


@pytest.mark.parametrize("host", ["10.1.2.3", "node-7.cluster", "fd00::1", "[fd00::1]"])
def test_cluster_store_with_loopback_devices_warns_naming_the_variable(host):
    msg = loopback_mismatch("lo", host)
    assert msg is not None and "FASTSYNC_NET_DEVICES" in msg and host in msg and "mlx5_0:1,eth0" in msg


@pytest.mark.parametrize("devices,host", [("lo", "127.0.0.1"), ("lo", "127.0.1.1"), ("lo", "::1"), ("lo", "[::1]"),
                                          ("lo", "localhost"), ("lo", None), ("eth0", "10.1.2.3"),
                                          ("mlx5_0:1,eth0", "node-7.cluster")])
def test_no_warning_when_consistent(devices, host):
    assert loopback_mismatch(devices, host) is None


def test_default_is_loopback_and_empty_is_refused(monkeypatch):
    monkeypatch.delenv("FASTSYNC_NET_DEVICES", raising=False)
    assert net_devices() == "lo"
    monkeypatch.setenv("FASTSYNC_NET_DEVICES", "mlx5_0:1,eth0")
    assert net_devices() == "mlx5_0:1,eth0"
    with pytest.raises(ConfigError, match="net devices"):
        net_devices("  ")
