"""``WeightSync(trace_dir=...)``: each trainer rank keeps a Chrome trace of its recent syncs.

Trainer rank r writes ``{trace_dir}/trainer{r}.json`` after every sync: its own phases (wait for
the receivers to begin, pack on the packer thread, post, drain = wait for completions, wait for
the flip) and, on rank 0, those of every engine rank it drives (backup, wait for the writes,
verify, apply, the engines' repack of prepacked CPU-kernel weights; the engine's slice spans the
whole time it was fenced: the engine stall). Times are wall-clock nanoseconds anchored per process
(``fastsync.trace.recorder``), so :func:`merge_trace_dir` lines the files up on one clock.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from fastsync.errors import ConfigError
from fastsync.trace import chrome, enable

__all__ = ["TraceDir", "merge_trace_dir"]


class TraceDir:
    """Keeps the last ``max_syncs`` syncs' rows of one trainer rank and rewrites its file."""

    def __init__(self, path: str | Path, rank: int, max_syncs: int = 200) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConfigError(f"trace_dir {self.path} is not an existing folder")
        if max_syncs < 1:
            raise ConfigError(f"trace_dir: max_syncs must be at least 1, got {max_syncs}")
        self.rank = rank
        self.file = self.path / f"trainer{rank}.json"
        self._syncs: deque[list[dict]] = deque(maxlen=max_syncs)
        enable()  # spans on in this process (every SyncMetrics from now on)

    def record(self, trainer_row: dict, engine_results: list) -> Path:
        """Add one sync: this rank's ``SyncMetrics.to_json()`` and what the engines returned
        (their rows carry ``"sync"`` when the engine recorded spans); rewrite the file."""
        rows = [trainer_row] if trainer_row else []
        for res in engine_results:
            for d in res if isinstance(res, list) else [res]:
                if isinstance(d, dict) and isinstance(d.get("sync"), dict):
                    rows.append(d["sync"])
        self._syncs.append(rows)
        b = chrome.TraceBuilder(kind="measured", source=f"WeightSync trainer rank {self.rank}")
        chrome.metrics_slices(b, [r for rows in self._syncs for r in rows])
        return chrome.write(self.file, b.build())


def merge_trace_dir(path: str | Path, out: str | Path | None = None) -> Path:
    """Merge every ``trainer*.json`` in ``path`` onto one clock into ``out`` (default
    ``{path}/merged.json``); returns the file written."""
    files = sorted(Path(path).glob("trainer*.json"))
    if not files:
        raise ConfigError(f"trace_dir {path}: no trainer*.json files to merge")
    target = Path(out) if out is not None else Path(path) / "merged.json"
    return chrome.write(target, chrome.merge_files(files))
