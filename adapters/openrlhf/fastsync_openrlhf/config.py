"""fastsync's options for OpenRLHF (``--fastsync.*``), carried to every trainer worker inside
OpenRLHF's own ``strategy.args`` (its ``hierarchize`` turns ``--fastsync.transport`` into
``args.fastsync.transport``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from fastsync_openrlhf._fastsync import (
    FANOUTS,
    MOE_BACKENDS,
    VERIFY_MODES,
    ConfigError,
    Spelling,
    check_sync_options,
    verify_mode,
)

__all__ = ["FastSyncOptions", "add_arguments", "options_from_args"]

_TRANSPORTS = ("nixl", "torch")
_MOE_BACKENDS = ("off", *MOE_BACKENDS)
_SPELLING = Spelling(prefix="--fastsync.", cli=True)


@dataclass(kw_only=True, slots=True, frozen=True)
class FastSyncOptions:
    """``enable``: sync with fastsync (False: OpenRLHF's own broadcast, unchanged). ``transport``:
    ``nixl`` (one-sided WRITEs) or ``torch`` (gloo point-to-point; for debugging).
    ``timeout_s``: deadline of every set-up step and sync. ``control_host``: the address trainer
    rank 0 serves the control plane on (default: Ray's node IP). ``verify``: what engine ranks check before each flip (off, sample, full; ``WeightSync(verify=...)``).
    ``moe``: swap HF MoE blocks for fastsync's (``fastsync.patch_moe``) with this backend.
    ``delta``: after a dense first sync, send only what changed (NIXL). ``fanout``: several
    identical engines (``--vllm.num_engines``) planned once and fed through relays between their
    ranks (``chain``), as the cost model picks (``auto``) or from the trainer ranks (``direct``)."""

    enable: bool = True
    transport: str = "nixl"
    timeout_s: float = 120.0
    control_host: str | None = None
    verify: bool | str = "off"
    moe: str = "off"
    delta: bool = False
    fanout: str = "off"

    def validate(self) -> "FastSyncOptions":
        if self.transport not in _TRANSPORTS:
            raise ConfigError(f"--fastsync.transport must be one of {_TRANSPORTS}, got {self.transport!r}")
        if self.moe not in _MOE_BACKENDS:
            raise ConfigError(f"--fastsync.moe must be one of {_MOE_BACKENDS}, got {self.moe!r}")
        check_sync_options(_SPELLING, transport=self.transport, timeout_s=self.timeout_s, delta=self.delta,
                           fanout=self.fanout)
        object.__setattr__(self, "verify", verify_mode(self.verify, "--fastsync.verify"))
        return self


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--fastsync.*`` group to OpenRLHF's parser (or any parser)."""
    g = parser.add_argument_group("fastsync", "fastsync weight sync and MoE swap (fastsync_openrlhf)")
    g.add_argument("--fastsync.disable", dest="fastsync.enable", action="store_false", default=True,
                   help="keep OpenRLHF's own per-parameter broadcast (no fastsync sync)")
    g.add_argument("--fastsync.transport", choices=_TRANSPORTS, default="nixl",
                   help="nixl: every DeepSpeed rank WRITEs its ZeRO-3 partitions into the engines (default)")
    g.add_argument("--fastsync.timeout_s", type=float, default=120.0, help="deadline of each set-up step and sync")
    g.add_argument("--fastsync.control_host", default=None,
                   help="address trainer rank 0 serves fastsync's control plane on (default: Ray's node IP)")
    g.add_argument("--fastsync.verify", nargs="?", const="full", default="off", choices=VERIFY_MODES,
                   help="what every engine rank checks before each flip: off, sample, full (the bare flag: full)")
    g.add_argument("--fastsync.delta", action="store_true", default=False,
                   help="after a dense first sync, send only the elements that changed (NIXL)")
    g.add_argument("--fastsync.fanout", choices=FANOUTS, default="off",
                   help="several identical vLLM engines: plan one, feed the others by relays (chain), by the cost "
                        "model's choice (auto) or from the trainer ranks (direct)")
    g.add_argument("--fastsync.moe", choices=_MOE_BACKENDS, default="off",
                   help="swap the actor's HF MoE blocks for fastsync's grouped-GEMM blocks with this backend")


def options_from_args(args: Any) -> FastSyncOptions:
    """The options from OpenRLHF's hierarchized ``args`` (``args.fastsync``); defaults when absent
    (OpenRLHF started without the launcher)."""
    ns = getattr(args, "fastsync", None)
    if ns is None:
        return FastSyncOptions()
    known = {f.name for f in fields(FastSyncOptions)}
    got = vars(ns)
    unknown = set(got) - known
    if unknown:
        raise ConfigError(f"unknown --fastsync option(s): {sorted(unknown)}")
    return FastSyncOptions(**got).validate()
