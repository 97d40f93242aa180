"""``one_version``: the one "every worker serves one version" check behind every engine handle
(in-process vLLM, HTTP replicas, verl's server, OpenRLHF's Ray actors)."""

from __future__ import annotations

import pytest

from fastsync import SyncError, one_version


def test_one_version_agrees_or_names_the_engine() -> None:
    assert one_version([4, 4, "4"], "engine e0") == 4  # an RPC may carry it as text
    with pytest.raises(SyncError, match=r"engine e0: workers serve different versions \[3, 4\]"):
        one_version([3, 4, 4], "engine e0")
    with pytest.raises(SyncError, match="engine e1: no worker answered"):
        one_version([], "engine e1")
