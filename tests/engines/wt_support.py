"""Shared by the tests of fastsync's vLLM weight-transfer backend (not a test module).

``plugin_path(tmp)``: vLLM finds fastsync's backend through the ``vllm.general_plugins`` entry
point ``fastsync_weight_transfer`` (pyproject.toml). An environment whose installed metadata
predates that entry point (an editable install made before it was added, e.g. a shared venv)
would not load it; there this writes the metadata pyproject.toml declares (every entry-point
group, the same distribution name) into ``tmp`` and returns that folder, to be put first on the
path of the test's processes, where it shadows the stale copy. Returns None when the installed
metadata already has the entry point (a fresh ``pip install -e .``, as in CI).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "fastsync_weight_transfer"


def _declared() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def plugin_path(tmp: str | os.PathLike) -> str | None:
    project = _declared()
    declared = project["entry-points"]["vllm.general_plugins"]
    assert ENTRY in declared, f"pyproject.toml declares no vllm.general_plugins entry point {ENTRY!r}"
    if any(ep.name == ENTRY and ep.value == declared[ENTRY] for ep in md.entry_points(group="vllm.general_plugins")):
        return None
    out = Path(tmp) / "entry-points"
    info = out / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    (info / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items()))
    return str(out)


def use_plugin_path(tmp: str | os.PathLike) -> dict[str, str]:
    """Put :func:`plugin_path` first on this process's path and on its children's
    (``PYTHONPATH``); return the environment additions for subprocesses."""
    path = plugin_path(tmp)
    if path is None:
        return {}
    if path not in sys.path:
        sys.path.insert(0, path)
    pp = os.environ.get("PYTHONPATH", "")
    if path not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = path + (os.pathsep + pp if pp else "")
    return {"PYTHONPATH": os.environ["PYTHONPATH"]}
