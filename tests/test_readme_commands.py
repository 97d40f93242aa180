"""The ``fastsync`` commands README.md and the docs site show, read from the pages themselves
(issue 21: every command the README shows is run by a test, in the shape it shows; issue 41: the
same for the pages under ``docs/`` and the adapters' READMEs the site includes).

* every concrete ``fastsync ...`` line (fenced blocks and inline code; ``a|b|c`` alternatives
  expanded; synopses with ``[...]``/placeholders and lines starting ``...`` left out) parses with
  the real CLI parser, exactly as written;
* every ``fastsync plan`` line runs as written (pure CPU);
* every ``fastsync bench`` line without ``--hosts`` (which needs root; ``tests/net/`` runs those)
  runs with a smaller ``--size-gb`` and ``--steps``, after checking that the README's own line
  parses to the same arguments but for those two.

The other commands (demo, the other benches, examples, launchers) are run by the tests the
report of issue 21 lists; this file checks that their lines still parse, that every ``make``
target shown exists in the Makefile, every ``python -m`` module shown can be found, and every
``python examples/...`` (or ``scripts/``) file shown exists.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fastsync.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: every page a user reads: the README, the docs site, and the adapters' READMEs it includes
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "adapters/verl/README.md",
         ROOT / "adapters/openrlhf/README.md"]
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z_:]*|F\.\w+|\.\.\.)$")  # DIR, PRESET, T:E, F.json, ...


def _alternatives(cmd: str) -> list[str]:
    """``--pause-mode wait|abort|keep`` -> one command per alternative."""
    tokens = cmd.split(" ")
    for i, tok in enumerate(tokens):
        if "|" in tok and not tok.startswith("|"):
            return [c for alt in tok.split("|") for c in _alternatives(" ".join(tokens[:i] + [alt] + tokens[i + 1:]))]
    return [cmd]


def code_lines(text: str) -> list[str]:
    """Every line of every fenced block, and every inline code span outside them."""
    found: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        found += block.splitlines()
    found += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return found


def readme_fastsync_commands(pages: list[Path] | None = None) -> list[str]:
    found: list[str] = []
    for page in pages or PAGES:
        found += code_lines(page.read_text())
    out: list[str] = []
    for raw in found:
        line = " ".join(raw.split("#", 1)[0].split())  # one line, comment dropped
        if not line.startswith("fastsync ") or "[" in line or r"\|" in line:
            continue  # not a command, or a synopsis
        for cmd in _alternatives(line):
            argv = shlex.split(cmd)[1:]
            if any(PLACEHOLDER.match(t) for t in argv) or cmd in out:
                continue
            if len(argv) == 1 and argv[0] not in ("demo", "plugins"):
                continue  # a command's name in prose ("`fastsync bench` above"), not a command line
            if len(argv) == 2 and argv[1].startswith("--") and argv[0] != "demo":
                continue  # a flag named in prose ("`fastsync bench --hosts`")
            out.append(cmd)
    return out


COMMANDS = readme_fastsync_commands()


def test_docs_show_commands_of_every_kind() -> None:
    kinds = {shlex.split(c)[1] for c in COMMANDS}
    assert {"plan", "bench", "demo", "moe-bench", "delta-bench", "reload-bench", "weight-transfer-bench"} <= kinds, kinds


def test_readme_commands_are_among_those_checked() -> None:
    readme = readme_fastsync_commands([README])
    assert set(readme) <= set(COMMANDS)


def _shell_words(pattern: str) -> set[tuple[str, str]]:
    """(page, match) for ``pattern`` at the start of a code line (or after ``&&`` / ``;``)."""
    out = set()
    for page in PAGES:
        for line in code_lines(page.read_text()):
            for part in re.split(r"&&|;|\|", line):
                m = re.match(pattern, " ".join(part.split()))
                if m:
                    out.add((page.relative_to(ROOT).as_posix(), m.group(1)))
    return out


def test_make_targets_shown_exist() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    shown = _shell_words(r"^make ([a-z][\w-]*)")
    assert {t for _, t in shown} >= {"demo", "test", "test-fast"}
    assert {(p, t) for p, t in shown if t not in targets} == set()


def _module_exists(mod: str) -> bool:
    """Whether ``mod`` can be imported, found without importing anything (a parent package's
    ``__init__`` can take seconds: vLLM, verl)."""
    import importlib.util

    top, *rest = mod.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if not rest:
        return True
    for base in spec.submodule_search_locations or []:
        path = Path(base, *rest)
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return True
    return False


def test_python_modules_shown_can_be_found() -> None:
    shown = _shell_words(r"^(?:\S+=\S+ )*(?:\S*python\S*) -m ([\w.]+)")
    assert {m for _, m in shown} >= {"fastsync_openrlhf.train_ppo_ray", "verl.trainer.main_ppo"}
    assert {(p, m) for p, m in shown if not _module_exists(m)} == set()


def test_files_shown_to_run_exist() -> None:
    shown = _shell_words(r"^(?:\S+=\S+ )*(?:\S*python\S*|bash) ((?:examples|scripts|fastsync|tests)/[\w/.-]+)")
    assert {(p, f) for p, f in shown if not (ROOT / f).exists()} == set()


@pytest.mark.parametrize("cmd", COMMANDS)
def test_readme_command_parses_as_written(cmd: str) -> None:
    argv = shlex.split(cmd)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's usage error
        pytest.fail(f"README command does not parse (exit {e.code}): {cmd}")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if shlex.split(c)[1] == "plan"])
def test_readme_plan_command_runs_as_written(cmd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # --plot docs/... and --trace ... land here, not in the checkout
    (tmp_path / "docs").mkdir()
    rc = main(shlex.split(cmd)[1:])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    assert "predicted" in out.out, out.out[-2000:]


BENCH = [c for c in COMMANDS if shlex.split(c)[1] == "bench" and "--hosts" not in c]


def _smaller(argv: list[str]) -> list[str]:
    """The same command with ``--size-gb 0.003`` and ``--steps 1`` (added when absent)."""
    out = list(argv)
    for flag, value in (("--size-gb", "0.003"), ("--steps", "1")):
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cmd", BENCH)
def test_readme_bench_command_runs_smaller(cmd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    argv = shlex.split(cmd)[1:]
    small = _smaller(argv)
    want, got = vars(build_parser().parse_args(argv)), vars(build_parser().parse_args(small))
    differ = {k for k in want if want[k] != got[k]}
    assert differ <= {"size_gb", "steps"}, differ  # the README's own shape, but for the size
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    rc = main(small + ["--timeout", "120"])
    out = capsys.readouterr()
    assert rc == 0, (out.out[-2000:], out.err[-2000:])
    for name in ("--trace", "--plot"):
        if name in argv:
            assert (tmp_path / argv[argv.index(name) + 1]).stat().st_size > 0, name
