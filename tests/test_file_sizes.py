"""Files stay small enough to read (issue 40, style.md: one mechanism per file): no module of
``fastsync/`` over :data:`MAX_LINES` lines, and the vLLM worker extension, the thin layer of RPC
verbs over the engine session, under :data:`LIMITS`'s own bound. A file that grows past its bound
is split by mechanism, not cut in the middle."""

from __future__ import annotations

import pathlib

import fastsync

PACKAGE = pathlib.Path(fastsync.__file__).parent
MAX_LINES = 450
#: files held to a tighter bound than MAX_LINES, relative to the package
LIMITS = {"engines/vllm/extension.py": 300}


def oversized(package: pathlib.Path) -> list[str]:
    """``path: lines > bound`` for every ``.py`` file under ``package`` over its bound."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        bound = LIMITS.get(rel, MAX_LINES)
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > bound:
            out.append(f"fastsync/{rel}: {n} lines > {bound}")
    return out


def test_no_file_in_fastsync_is_over_its_bound():
    assert oversized(PACKAGE) == []


def test_every_tighter_bound_names_a_file():
    assert all((PACKAGE / rel).is_file() for rel in LIMITS)


def test_the_check_fails_on_a_long_file(tmp_path: pathlib.Path):
    (tmp_path / "engines" / "vllm").mkdir(parents=True)
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "engines" / "vllm" / "extension.py").write_text("x = 1\n" * 301)
    assert oversized(tmp_path) == ["fastsync/engines/vllm/extension.py: 301 lines > 300",
                                   f"fastsync/long.py: {MAX_LINES + 1} lines > {MAX_LINES}"]
