"""The docs site builds in strict mode (issue 41): a broken link, a missing anchor, a page left out
of the navigation or a missing included file fails the build, and so this test. Also the README
stays a landing page, and every error class a user can meet has its entry in troubleshooting."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs", reason="mkdocs is in requirements/dev.txt; this environment lacks it")
pytest.importorskip("material", reason="mkdocs-material is in requirements/dev.txt; this environment lacks it")


def test_docs_build_strict(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert "rank-0 funnel" in home  # the home page is README.md (scripts/mkdocs_hooks.py)
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


def test_readme_is_a_landing_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for must in ("make demo", "make test", "make test-fast", "WeightSync", "verl", "OpenRLHF",
                 "weight-transfer", "## Results", "## Limits", "docs/benchmarks.md"):
        assert must in text, must


def _error_classes() -> set[str]:
    """Every FastSyncError subclass defined in the package (read from the source, no imports)."""
    names = {"FastSyncError"}
    defs = []
    for f in (ROOT / "fastsync").rglob("*.py"):
        defs += re.findall(r"^class (\w+)\((\w+)\):", f.read_text(), re.M)
    grew = True
    while grew:
        grew = False
        for cls, base in defs:
            if base in names and cls not in names:
                names.add(cls)
                grew = True
    return names


def test_troubleshooting_has_every_error_class() -> None:
    headings = set(re.findall(r"^## (\w+)$", (ROOT / "docs" / "troubleshooting.md").read_text(), re.M))
    classes = _error_classes()
    assert {"ConfigError", "SyncError", "HookPointError"} <= classes
    assert classes <= headings, f"docs/troubleshooting.md lacks: {sorted(classes - headings)}"


def test_benchmark_data_say_how_they_were_made() -> None:
    """Every ``--json`` output kept under docs/data names its command, date and CPU, and its
    command is one the benchmarks page shows."""
    import json

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    files = sorted((ROOT / "docs" / "data").rglob("*.json"))
    assert files
    for f in files:
        rec = json.loads(f.read_text())
        assert {"command", "date", "cpu", "output"} <= set(rec), f
        assert rec["command"].removesuffix(" --json") in page, f
