"""The ``fastsync`` commands README.md shows, read from README.md itself (issue 21: every command
the README shows is run by a test, in the shape it shows).

* every concrete ``fastsync ...`` line (fenced blocks and inline code; ``a|b|c`` alternatives
  expanded; synopses with ``[...]``/placeholders and lines starting ``...`` left out) parses with
  the real CLI parser, exactly as written;
* every ``fastsync plan`` line runs as written (pure CPU);
* every ``fastsync bench`` line without ``--hosts`` (which needs root; ``tests/net/`` runs those)
  runs with a smaller ``--size-gb`` and ``--steps``, after checking that the README's own line
  parses to the same arguments but for those two.

The other commands (demo, the other benches, examples, launchers) are run by the tests the
report of issue 21 lists; this file checks that their README lines still parse.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fastsync.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z_:]*|F\.\w+|\.\.\.)$")  # DIR, PRESET, T:E, F.json, ...


def _alternatives(cmd: str) -> list[str]:
    """``--pause-mode wait|abort|keep`` -> one command per alternative."""
    tokens = cmd.split(" ")
    for i, tok in enumerate(tokens):
        if "|" in tok and not tok.startswith("|"):
            return [c for alt in tok.split("|") for c in _alternatives(" ".join(tokens[:i] + [alt] + tokens[i + 1:]))]
    return [cmd]


def readme_fastsync_commands() -> list[str]:
    text = README.read_text()
    found: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        found += block.splitlines()
    found += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
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


def test_readme_shows_commands_of_every_kind() -> None:
    kinds = {shlex.split(c)[1] for c in COMMANDS}
    assert {"plan", "bench", "demo", "moe-bench", "delta-bench", "reload-bench", "weight-transfer-bench"} <= kinds, kinds


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
