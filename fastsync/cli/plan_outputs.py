"""What ``fastsync plan`` writes besides its table: the predicted trace (``--trace``) and the
bytes-per-NIC figure (``--plot``). Both come from the same ``simulate`` call as the printed time."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["add_arguments", "check_arguments", "write_outputs"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="write the simulated schedule as Chrome trace-event JSON (open in ui.perfetto.dev)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write a figure of bytes per NIC with the bound and prediction (.png, .svg or .pdf)")


def check_arguments(args: argparse.Namespace) -> None:
    """Bad output paths fail before minutes of planning, not after."""
    for flag, value, suffixes in (("--trace", getattr(args, "trace", None), (".json",)),
                                  ("--plot", getattr(args, "plot", None), (".png", ".svg", ".pdf"))):
        if value is None:
            continue
        p = Path(value)
        if p.suffix.lower() not in suffixes:
            raise ConfigError(f"{flag} {value}: the file name must end in {' or '.join(suffixes)}")
        if not p.parent.exists():
            raise ConfigError(f"{flag} {value}: folder {p.parent} does not exist")


def write_outputs(args: argparse.Namespace, plan: Any, sim: Any, events: list[dict] | None, title: str) -> dict:
    """Write the requested files; returns ``{"trace_file": ..., "plot_file": ...}`` (None when not asked)."""
    out: dict[str, Any] = {"trace_file": None, "plot_file": None}
    if getattr(args, "trace", None):
        from fastsync.trace import chrome

        b = chrome.TraceBuilder(kind="predicted", title=title, predicted_seconds=sim.predicted_seconds,
                                lower_bound_seconds=sim.lower_bound_seconds, bottleneck=sim.bottleneck)
        for ev in events or []:
            if ev["kind"] == "slice":
                start = round(ev["start_s"] * 1e9)  # end rounded too: back-to-back slices stay so
                b.slice(ev["role"], ev["rank"], ev["thread"], ev["name"], start,
                        round((ev["start_s"] + ev["dur_s"]) * 1e9) - start, ev["args"])
            else:
                b.counter(ev["name"], round(ev["t_s"] * 1e9), ev["values"])
        out["trace_file"] = str(chrome.write(args.trace, b.build(origin_ns=0)))
    if getattr(args, "plot", None):
        from fastsync.trace.plot import plot_nic_bytes

        out["plot_file"] = str(plot_nic_bytes(args.plot, send_bytes=plan.send_bytes(), recv_bytes=plan.recv_bytes(),
                                              nic_gbps=args.nic_gbps, predicted_s=sim.predicted_seconds,
                                              lower_bound_s=sim.lower_bound_seconds, title=title))
    return out
