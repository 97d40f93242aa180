"""Seeing a sync: span recording, Chrome trace-event files, plots and progress on stderr.

* ``recorder.py``: the process-wide switch and the clock spans are stamped with (cheap when off).
* ``chrome.py``: slices -> Chrome trace-event JSON (Perfetto, chrome://tracing), validation, and the
  merge of per-process files onto one clock.
* ``plot.py``: small static figures with matplotlib (Agg): bytes per NIC, a timeline.
* ``progress.py``: progress on stderr for the long commands, only on a terminal.

Nothing here imports torch or anything above ``errors``; every other layer may use it.
"""

from fastsync.trace.recorder import enable, enabled, new_spans, now_ns

__all__ = ["enable", "enabled", "new_spans", "now_ns"]
