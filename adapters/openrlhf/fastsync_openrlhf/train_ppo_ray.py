"""``python -m fastsync_openrlhf.train_ppo_ray [OpenRLHF's train_ppo_ray arguments] [--fastsync.*]``

Checks every hook point in the installed OpenRLHF (a moved one stops here, naming the attribute
and the supported versions), rebinds ``RolloutRayActor`` and ``PolicyModelActor`` in OpenRLHF's
modules to fastsync's subclasses, adds the ``--fastsync.*`` group to OpenRLHF's own argument
parser (its parser is built inline under ``__main__``, so it is extended at its ``parse_args``
call), then runs ``openrlhf.cli.train_ppo_ray`` as ``__main__``. The parsed ``--fastsync.*``
values travel to every trainer worker inside OpenRLHF's ``strategy.args``.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from fastsync_openrlhf import hooks
from fastsync_openrlhf.config import FastSyncOptions, add_arguments

__all__ = ["main", "fastsync_arguments"]

CLI = "openrlhf.cli.train_ppo_ray"


def _check(ns: argparse.Namespace) -> None:
    opts = {k.split(".", 1)[1]: v for k, v in vars(ns).items() if k.startswith("fastsync.")}
    FastSyncOptions(**opts).validate()
    colocate = getattr(ns, "train.colocate_all", False)
    if opts.get("enable", True) and colocate and getattr(ns, "vllm.sync_backend", "nccl") == "nccl" \
            and not getattr(ns, "train.async_enable", False):
        from fastsync_openrlhf.trainer import COLOCATE_MESSAGE

        print(COLOCATE_MESSAGE, flush=True)


@contextmanager
def fastsync_arguments() -> Iterator[None]:
    """While active, the first ``ArgumentParser.parse_args`` call (OpenRLHF's) gets the
    ``--fastsync.*`` group added first (so ``--help`` lists both) and its result checked."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args=None, namespace=None):  # type: ignore[no-untyped-def]
        argparse.ArgumentParser.parse_args = original  # one parser: OpenRLHF's
        add_arguments(self)
        ns = original(self, args, namespace)
        _check(ns)
        return ns

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        hooks.install()
    except hooks.HookPointError as e:
        raise SystemExit(f"error: {e}") from e
    saved = sys.argv
    sys.argv = [f"{__name__} (OpenRLHF {CLI})", *argv]
    try:
        with fastsync_arguments():
            runpy.run_module(CLI, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
