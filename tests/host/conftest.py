"""A real control store on loopback for the host kit's tests, closed after each test."""

from __future__ import annotations

import pytest

from fastsync import TCPStoreControl


@pytest.fixture()
def ctl():
    c = TCPStoreControl.server(port=0, host="127.0.0.1")
    yield c.with_prefix("t")
    c.close()
