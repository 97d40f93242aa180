"""``fastsync trace``: work with trace files written by ``plan --trace``, ``bench --trace`` and
``WeightSync(trace_dir=...)``.

Example::

    fastsync trace merge traces/ -o run.json          # every trainer*.json in traces/, one clock
    fastsync trace check run.json plan.json           # valid trace-event JSON? tracks per rank
    fastsync trace plot run.json -o run.png --versions 5 6 7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastsync.errors import ConfigError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="merge, check or plot Chrome trace files of syncs (predicted or measured)",
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    ops = p.add_subparsers(dest="op", required=True, metavar="OP")
    m = ops.add_parser("merge", help="merge per-process trace files (or a trace_dir) onto one clock")
    m.add_argument("inputs", nargs="+", help="trace files, or a folder of trainer*.json")
    m.add_argument("-o", "--out", required=True, help="merged trace file (.json)")
    c = ops.add_parser("check", help="validate trace files and list their tracks")
    c.add_argument("inputs", nargs="+")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    g = ops.add_parser("plot", help="draw a trace's timeline (.png, .svg or .pdf)")
    g.add_argument("input")
    g.add_argument("-o", "--out", required=True)
    g.add_argument("--versions", type=int, nargs="*", default=None, help="only these syncs (measured traces)")
    g.add_argument("--title", default="")
    p.set_defaults(func=run)


def _files(inputs: list[str]) -> list[Path]:
    out: list[Path] = []
    for i in inputs:
        p = Path(i)
        if p.is_dir():
            found = sorted(p.glob("trainer*.json"))
            if not found:
                raise ConfigError(f"trace folder {p}: no trainer*.json files")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"trace input {p}: no such file or folder")
    return out


def run(args: argparse.Namespace) -> int:
    from fastsync.trace import chrome

    if args.op == "merge":
        if not args.out.endswith(".json"):
            raise ConfigError(f"--out {args.out}: the file name must end in .json")
        path = chrome.write(args.out, chrome.merge_files(_files(args.inputs)))
        print(f"merged {len(_files(args.inputs))} file(s) into {path}")
        return 0
    if args.op == "check":
        report = {}
        for f in _files(args.inputs):
            trace = chrome.load(f)
            xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
            report[str(f)] = {"tracks": sorted(chrome.process_names(trace).values()), "slices": len(xs),
                              "kind": trace.get("otherData", {}).get("kind"),
                              "seconds": (max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)) / 1e6
                              if xs else 0.0}
        if args.json:
            print(json.dumps(report))
        else:
            for f, r in report.items():
                print(f"{f}: valid, {r['kind'] or 'trace'}, {len(r['tracks'])} tracks, {r['slices']} slices, "
                      f"{r['seconds']:.3f} s")
        return 0
    from fastsync.trace.plot import plot_timeline

    path = plot_timeline(args.out, chrome.load(args.input), title=args.title, versions=args.versions)
    print(f"figure: {path}")
    return 0
