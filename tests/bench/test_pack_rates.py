"""The host rig's packing probe: one rate per FP8 transform, measured with as many packers at
once as the sync has trainer ranks (they share the machine's cores), refused without one."""

from __future__ import annotations

import pytest

from fastsync.bench.cluster import pack_rates
from fastsync.errors import ConfigError


@pytest.mark.slow
def test_pack_rates_per_packer_with_packers_at_once() -> None:
    one, two = pack_rates(1), pack_rates(2)
    assert {"fp8_block", "fp8_scale"} <= set(one) and set(one) == set(two)
    assert all(r > 0 for r in (*one.values(), *two.values()))


def test_pack_rates_refuses_no_packer() -> None:
    with pytest.raises(ConfigError, match="pack_rates: packers must be at least 1, got 0"):
        pack_rates(0)


def test_a_transform_the_probe_cannot_run_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastsync.executor.pack as pack

    real = pack.transform_into

    def no_block(out, src, name, *a, **k):
        if name == "fp8_block":
            raise RuntimeError("not on this CPU")
        return real(out, src, name, *a, **k)

    monkeypatch.setattr(pack, "transform_into", no_block)
    got = pack_rates(2)
    assert "fp8_block" not in got and got["fp8_scale"] > 0
