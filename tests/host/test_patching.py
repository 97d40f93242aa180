"""Hook points found by name and wrapped once (``fastsync.host.patching``), as the verl and OpenRLHF
adapters use them: a moved hook point is named with the supported versions, a second install does
not wrap twice, unwrap restores the original."""

from __future__ import annotations

import pytest

from fastsync import ConfigError, HookPointError, is_wrapped, resolve_hook_point, unwrap_hook_point, wrap_hook_point


class _Host:
    def step(self, x: int) -> int:
        """The host's own step."""
        return x + 1


def test_resolve_names_the_missing_module_or_attribute_and_the_supported_versions() -> None:
    kw = {"adapter": "fastsync_demo", "dist": "torch", "supported": ("9.9",)}
    assert resolve_hook_point("fastsync.host.patching", "wrap", **kw) is wrap_hook_point
    with pytest.raises(HookPointError, match=r"attribute fastsync\.host\.patching\.gone is missing in the installed "
                                             r"torch \(\d.*Supported torch versions: 9\.9"):
        resolve_hook_point("fastsync.host.patching", "gone", **kw)
    with pytest.raises(HookPointError, match="module 'fastsync.nowhere' cannot be imported"):
        resolve_hook_point("fastsync.nowhere", "x", **kw)


def test_wrap_is_once_keeps_the_original_and_unwrap_restores_it() -> None:
    original = _Host.step
    calls = []

    def make(orig):
        def step(self, x):
            calls.append(x)
            return orig(self, x) * 10

        return step

    try:
        assert wrap_hook_point(_Host, "step", make, who="test") is True
        assert wrap_hook_point(_Host, "step", make, who="test") is False  # already wrapped: not twice
        assert _Host().step(1) == 20 and calls == [1]
        assert is_wrapped(_Host.step) and _Host.step.__wrapped__ is original and _Host.step.__doc__ == original.__doc__
    finally:
        assert unwrap_hook_point(_Host, "step") is True
    assert _Host.step is original and unwrap_hook_point(_Host, "step") is False
    with pytest.raises(ConfigError, match=r"test: _Host\.missing not found"):
        wrap_hook_point(_Host, "missing", make, who="test")
