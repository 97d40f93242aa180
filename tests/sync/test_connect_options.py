"""The options that cross to an engine's workers (``fastsync.sync.connect_options``): built once
on the trainer side, read back key by key on the worker side, every bad key named."""

from __future__ import annotations

import pytest

from fastsync.errors import ConfigError
from fastsync.sync.connect_options import ConnectOptions, ReloadReceiveOptions, ReloadSendOptions, StoreAddress


def test_a_record_crosses_as_a_dict_and_comes_back_equal() -> None:
    sent = ConnectOptions(control_port=29500, control_host="198.18.0.1", control_prefix="job/3",
                          control_secret="ab" * 16, transport="nixl", transport_options={"in_flight": 4},
                          timeout_s=30, verify=True, delta=True)
    wire = sent.wire()
    assert wire["control_host"] == "198.18.0.1" and wire["delta"] is True and wire["staged"] is False
    got = ConnectOptions.parse(wire)
    assert got == sent and isinstance(got.timeout_s, float)
    # what the worker needs no more than the port: the rest defaults as before the record existed
    assert ConnectOptions.parse({"control_port": 1}) == ConnectOptions(control_port=1)


@pytest.mark.parametrize("options, named", [
    ({"control_port": 1, "pause_mode": "keep"}, "unknown option(s) ['pause_mode']"),
    ({"timeout_s": 5.0}, "options need 'control_port'"),
    ({"control_port": True}, "'control_port' must be int"),
    ({"control_port": "29500"}, "'control_port' must be int"),
    ({"control_port": 70000}, "'control_port' must be a TCP port"),
    ({"control_port": 1, "timeout_s": "5"}, "'timeout_s' must be float"),
    ({"control_port": 1, "timeout_s": -1}, "'timeout_s' must be above 0"),
    ({"control_port": 1, "timeout_s": float("inf")}, "'timeout_s' must be a finite number"),
    ({"control_port": 1, "verify": 1}, "'verify' must be bool or str"),
    ({"control_port": 1, "verify": "most"}, "'verify' must be one of"),
    ({"control_port": 1, "control_secret": 7}, "'control_secret' must be str or None"),
    ({"control_port": 1, "transport_options": [1]}, "'transport_options' must be dict or None"),
    ({"control_port": 1, "control_prefix": ""}, "'control_prefix' must not be empty"),
    ({"control_port": 1, "staged": True, "delta": True}, "staged=True with delta=True"),
    ({"control_port": 1, "delta": True, "transport": "torch"}, "delta=True writes over NIXL; transport='torch'"),
])
def test_bad_options_are_refused_naming_the_call_and_the_key(options: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        ConnectOptions.parse(options)
    assert str(e.value).startswith("fastsync_connect: ") and named in str(e.value), str(e.value)


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(ConfigError, match="fastsync_connect: options must be a dict, got list"):
        ConnectOptions.parse([("control_port", 1)])  # type: ignore[arg-type]


def test_reload_options_need_their_attempts_namespace_and_versions() -> None:
    with pytest.raises(ConfigError, match="fastsync_reload_receive: options need 'control_prefix', "
                                          "'handshake_version', 'weight_version'"):
        ReloadReceiveOptions.parse({"control_port": 1})
    with pytest.raises(ConfigError, match=r"fastsync_reload_receive: unknown option\(s\) \['chunk_bytes'\]"):
        ReloadReceiveOptions.parse({"control_port": 1, "control_prefix": "reload/1/0", "handshake_version": 1,
                                    "weight_version": 4, "chunk_bytes": 1 << 20})
    send = ReloadSendOptions.parse({"control_port": 1, "control_prefix": "reload/1/0", "handshake_version": 1,
                                    "weight_version": 4, "rank_offset": 2, "chunk_bytes": 1 << 20, "in_flight": 3})
    assert (send.rank_offset, send.chunk_bytes, send.in_flight) == (2, 1 << 20, 3)
    # a joining engine's own connect: the attempt's store namespace, NIXL, the attempt's deadline
    recv = ReloadReceiveOptions(control_port=1, control_prefix="reload/1/0", control_secret="cd" * 16,
                                handshake_version=1, weight_version=4, timeout_s=9.0)
    assert recv.connect() == ConnectOptions(control_port=1, control_prefix="reload/1/0", control_secret="cd" * 16,
                                            transport="nixl", timeout_s=9.0)


def test_the_address_of_a_live_store_carries_its_secret_as_hex() -> None:
    from fastsync.control import TCPStoreControl

    secret = bytes(range(32))
    server = TCPStoreControl.server(0, secret=secret, prefix="job")
    try:
        addr = StoreAddress.of(server)
        assert addr == {"control_port": server.port, "control_host": "127.0.0.1", "control_prefix": "job",
                        "control_secret": secret.hex()}
        client = StoreAddress(**addr).control()  # the worker's client, authenticated with the same secret
        client.set("k", b"v")
        assert server.get("k", 5.0) == b"v"
        client.close()
    finally:
        server.close()
