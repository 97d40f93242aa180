"""The control-store keys and error texts of fastsync's backend of vLLM's weight-transfer API.

The keys are built in :mod:`fastsync.protocol` (``wt_*``) and re-exported here under their short
names. vLLM's calls carry small JSON and return nothing a trainer can read (the HTTP client keeps only a
status code), so the workers and trainer rank 0 meet under these keys, below the set-up's prefix:
descriptions, the plan, connect results, per-version results and, with staged receive, the version
to open and when its writes landed. Errors travel as ``err:{Type}:{message}``.
"""

from __future__ import annotations

from fastsync.errors import error_text, raise_error_text  # the one codec, re-exported for the wt modules
from fastsync.protocol import wt_connect_key as connect_key
from fastsync.protocol import wt_connected_key as connected_key
from fastsync.protocol import wt_describe_key as describe_key
from fastsync.protocol import wt_open_key as open_key
from fastsync.protocol import wt_staged_key as staged_key
from fastsync.protocol import wt_version_key as version_key

#: The store deadline a worker publishes its staged verdict with (``staged_key``), and so how long
#: past the workers' staging deadline trainer rank 0 still waits for it: their reason (which trainer
#: rank's writes are missing) beats a bare timeout.
PUBLISH_S = 5.0

__all__ = ["describe_key", "connect_key", "connected_key", "version_key", "open_key", "staged_key", "error_text",
           "raise_error_text", "PUBLISH_S"]
