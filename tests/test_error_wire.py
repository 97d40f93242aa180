"""Errors across a process boundary (``fastsync.errors``): one codec for a worker's RPC reply and
for a control-store value, the class kept, a foreign class never trusted."""

from __future__ import annotations

import pytest

from fastsync.errors import (ConfigError, FastSyncError, LayoutError, SyncError, error_from_text, error_text,
                             raise_error_text)
from fastsync.host.replies import error_reply, raise_worker_errors


@pytest.mark.parametrize("err, cls, message", [
    (LayoutError("engine rank 1: 'lm_head.weight' is [130, 96], expected [131, 96]"), LayoutError,
     "engine rank 1: 'lm_head.weight' is [130, 96], expected [131, 96]"),
    (ConfigError("a: b: c"), ConfigError, "a: b: c"),  # colons in the message survive
    (RuntimeError("CUDA out of memory"), SyncError, "RuntimeError: CUDA out of memory"),
])
def test_both_envelopes_raise_the_same_class_and_message(err: BaseException, cls: type, message: str) -> None:
    with pytest.raises(cls) as a:
        raise_error_text(error_text(err).encode(), "engine rank 1 (connect)")
    with pytest.raises(cls) as b:
        raise_worker_errors([{"rank": 0}, error_reply(err)], "engine rank 1 (connect)")
    assert type(a.value) is type(b.value) is cls
    assert str(a.value) == str(b.value) == f"engine rank 1 (connect): {message}"


@pytest.mark.parametrize("name", ["SystemExit", "error_text", "object", "KeyboardInterrupt", ""])
def test_a_class_name_from_a_peer_that_is_not_fastsyncs_becomes_fastsyncerror(name: str) -> None:
    got = error_from_text(f"err:{name}:boom", "peer")
    assert type(got) is FastSyncError and str(got) == "peer: boom"
    with pytest.raises(FastSyncError) as e:
        raise_worker_errors([{"error": [name, "boom"]}], "peer")
    assert type(e.value) is FastSyncError


def test_replies_without_an_error_pass_through() -> None:
    got = [{"rank": 0, "setup_s": 0.1}, {"rank": 1, "setup_s": 0.2}]
    assert raise_worker_errors(got, "engine") is got
