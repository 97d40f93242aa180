"""``fastsync`` command line: one module per subcommand, each with ``add_parser(subparsers)``.

Subcommands are imported lazily so ``fastsync plan`` never imports torch.distributed or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fastsync.errors import FastSyncError

__all__ = ["main"]

#: subcommand -> module under fastsync.cli that defines add_parser(subparsers)
SUBCOMMANDS = {
    "plan": "plan_cmd",
    "bench": "bench_cmd",
    "demo": "demo_cmd",
    "moe-bench": "moe_cmd",
    "plugins": "plugins_cmd",
    "trace": "trace_cmd",
    "delta-bench": "delta_cmd",
    "reload-bench": "reload_cmd",
    "weight-transfer-bench": "wt_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastsync", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(f"fastsync.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name == f"fastsync.cli.{module}":
                continue  # subcommand not built in this version
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage error (2, message already printed) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except FastSyncError as e:
        print(f"fastsync {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
