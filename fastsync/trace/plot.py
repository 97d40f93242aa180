"""Small static figures for READMEs and issues, drawn with matplotlib's Agg backend (no display).

* :func:`plot_nic_bytes`: bytes each trainer NIC sends and each engine NIC receives, sorted, with
  the lower bound (the busiest port at line rate) and the prediction marked.
* :func:`plot_timeline`: one bar row per rank and activity of a trace-event file (predicted or
  measured), the phases coloured by name.

matplotlib is optional (``pip install matplotlib``, pinned in requirements/lock.txt); asking for a
figure without it raises ConfigError saying what to install. The file type follows the suffix
(``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["plot_nic_bytes", "plot_timeline"]

_SUFFIXES = (".png", ".svg", ".pdf")


def _pyplot(path: str | Path) -> Any:
    if Path(path).suffix.lower() not in _SUFFIXES:
        raise ConfigError(f"figure {path}: the suffix must be one of {', '.join(_SUFFIXES)}")
    if not Path(path).parent.exists():
        raise ConfigError(f"figure {path}: folder {Path(path).parent} does not exist")
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError(f"figure {path}: needs matplotlib (pip install matplotlib): {e}") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_nic_bytes(path: str | Path, *, send_bytes: Sequence[int], recv_bytes: Sequence[int], nic_gbps: float,
                   predicted_s: float, lower_bound_s: float, title: str = "") -> Path:
    """Bytes per NIC (trainer send, engine receive), sorted high to low, in GB; dashed lines mark
    what one NIC moves at line rate in the lower bound's and in the predicted time."""
    plt = _pyplot(path)
    line = nic_gbps * 1e9 / 8
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.2), sharey=True, dpi=100)
    for ax, values, what, colour in ((axes[0], send_bytes, "trainer NICs: sent", "#4C72B0"),
                                     (axes[1], recv_bytes, "engine NICs: received", "#55A868")):
        ys = sorted((v / 1e9 for v in values), reverse=True)
        ax.bar(range(len(ys)), ys, width=1.0, color=colour, linewidth=0)
        ax.axhline(lower_bound_s * line / 1e9, color="black", linestyle="--", linewidth=1,
                   label=f"lower bound {lower_bound_s:.3f} s")
        ax.axhline(predicted_s * line / 1e9, color="#C44E52", linestyle=":", linewidth=1.5,
                   label=f"predicted {predicted_s:.3f} s")
        ax.set_title(f"{what} ({len(ys)})", fontsize=10)
        ax.set_xlabel("NIC (sorted by bytes)")
        ax.set_xlim(-0.5, max(len(ys), 1) - 0.5)
    axes[0].set_ylabel(f"GB per sync (line {nic_gbps:g} Gb/s)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_timeline(path: str | Path, trace: Mapping[str, Any], *, title: str = "", max_rows: int = 24,
                  versions: Sequence[int] | None = None) -> Path:
    """Draw a trace's slices as horizontal bars, one row per (rank, thread), at most ``max_rows``
    rows (the first ranks of each role; the rest are counted in the title). ``versions``: only the
    slices of these syncs (a measured trace's ``args.version``), times from the first one's start."""
    plt = _pyplot(path)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    rows: dict[tuple[int, int], list[dict]] = defaultdict(list)
    keep = set(versions) if versions is not None else None
    xs = [e for e in trace["traceEvents"]
          if e["ph"] == "X" and (keep is None or (e.get("args") or {}).get("version") in keep)]
    if not xs:
        raise ConfigError(f"figure {path}: no slices to draw" + (f" for versions {sorted(keep)}" if keep else ""))
    t0 = min(e["ts"] for e in xs)
    for e in xs:
        rows[(e["pid"], e["tid"])].append({**e, "ts": e["ts"] - t0})
    keys = sorted(rows)
    shown, hidden = keys[:max_rows], len({p for p, _ in keys[max_rows:]} - {p for p, _ in keys[:max_rows]})
    phases = sorted({_phase(e["name"]) for k in shown for e in rows[k]})
    cmap = plt.get_cmap("tab20")
    colour = {p: cmap(i % 20) for i, p in enumerate(phases)}
    fig, ax = plt.subplots(figsize=(9.0, 0.9 + 0.28 * len(shown)), dpi=100)
    for y, k in enumerate(shown):
        evs = rows[k]
        depth = _depths(evs)
        for e, d in zip(evs, depth):
            h = 0.8 if d == 0 else 0.5
            ax.barh(y, e["dur"] / 1e3, left=e["ts"] / 1e3, height=h, color=colour[_phase(e["name"])],
                    edgecolor="none", alpha=0.45 if d == 0 and len(set(depth)) > 1 else 1.0)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{names.get(p, p)} / {threads.get((p, t), t)}" for p, t in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[p]) for p in phases]
    ax.legend(handles, phases, fontsize=7, ncol=1 if len(phases) <= max(8, len(shown)) else 2,
              loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    more = f" (+{hidden} more ranks)" if hidden else ""
    if title or more:
        ax.set_title(title + more, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def _phase(name: str) -> str:
    """Colour key: a sync's own slice is ``sync``; grouped transfers are ``transfers``."""
    if name.startswith("v") and name[1:2].isdigit():
        return "sync"
    if "->" in name or "<-" in name or name.endswith("transfers"):
        return "transfers"
    return name


def _depths(evs: list[dict]) -> list[int]:
    """Nesting depth of each slice on one row (0: not inside another)."""
    out, stack = [], []
    for e in evs:
        while stack and e["ts"] >= stack[-1]:
            stack.pop()
        out.append(len(stack))
        stack.append(e["ts"] + e["dur"])
    return out
