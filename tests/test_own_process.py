"""``tests/support/own_process.py``: marked tests run in one child pytest per module (engines
in-process there), and their passes, failures, skips, output and deadline come back as the
tests' own. A real pytest runs a small test folder that uses the plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SUPPORT = str(Path(__file__).resolve().parent / "support")

CONFTEST = f"""
import sys
sys.path.insert(0, {SUPPORT!r})
pytest_plugins = ["own_process"]
"""
INI = """[pytest]
markers =
    own_process: in a child
"""
MARKED = """
import os, time
import pytest

own = pytest.mark.own_process


@pytest.fixture(scope="module")
def here():
    yield
    open("here-torn-down", "w").close()  # the parent's module fixture, torn down in the parent


def test_unmarked_first_sets_up_the_module_here(here):
    assert not os.environ.get("OWN_PROCESS_REPORTS")


@pytest.fixture(scope="module")
def shared():
    return {"n": 0, "pid": os.getpid()}


@own
def test_in_the_child_with_engines_in_process(shared):
    assert os.environ.get("OWN_PROCESS_REPORTS") and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert int(os.environ["OUTER_PYTEST_PID"]) != os.getpid()
    shared["n"] += 1


@own
def test_module_fixture_shared_in_the_child(shared):
    assert shared["n"] == 1 and shared["pid"] == os.getpid()


@own
def test_fails_with_its_message():
    assert 1 + 1 == 3, "the child's own failure text"


@own
def test_skips_with_its_reason():
    pytest.skip("the child's skip reason")


@own
@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    print(f"printed in the child {x}")
    if os.environ.get("OWN_PROCESS_SLEEP"):
        time.sleep(60)
"""
PLAIN = """
import os


def test_unmarked_runs_here():
    assert not os.environ.get("OWN_PROCESS_REPORTS")
    assert int(os.environ["OUTER_PYTEST_PID"]) == os.getpid()
"""


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    for name, text in (("conftest.py", CONFTEST), ("pytest.ini", INI), ("test_marked.py", MARKED),
                       ("test_plain.py", PLAIN)):
        (tmp_path / name).write_text(text)
    junit = tmp_path / "junit.xml"
    # the outer pytest's pid, read by the tests: a shell that execs pytest keeps its own pid
    cmd = f'OUTER_PYTEST_PID=$$ exec "{sys.executable}" -m pytest -q -rA -p no:cacheprovider --junitxml={junit} ' + " ".join(args)
    base = {k: v for k, v in os.environ.items() if k not in ("OWN_PROCESS_REPORTS", "PYTEST_ADDOPTS")}
    out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**base, **env})
    results = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        bad = next((c for c in tc if c.tag in ("failure", "skipped", "error")), None)
        results[tc.get("name")] = ("passed", "") if bad is None else (bad.tag, bad.get("message", "") + (bad.text or ""))
    return out, results


def test_marked_tests_report_from_the_child_and_unmarked_run_here(tmp_path):
    out, res = _run(tmp_path)
    assert out.returncode == 1, out.stdout[-3000:]  # one failure
    assert {n: k for n, (k, _) in res.items()} == {
        "test_in_the_child_with_engines_in_process": "passed", "test_module_fixture_shared_in_the_child": "passed",
        "test_fails_with_its_message": "failure", "test_skips_with_its_reason": "skipped",
        "test_param[1]": "passed", "test_param[2]": "passed", "test_unmarked_runs_here": "passed",
        "test_unmarked_first_sets_up_the_module_here": "passed"}, out.stdout[-3000:]
    # the next module set up cleanly after the marked tests (no "previous item was not torn down"),
    # and the parent's module fixture of the mixed module was torn down in the parent
    assert (tmp_path / "here-torn-down").exists()
    assert "the child's own failure text" in res["test_fails_with_its_message"][1]
    assert "the child's skip reason" in res["test_skips_with_its_reason"][1]
    assert "printed in the child 2" in out.stdout  # -rA shows the child's captured output


def test_selection_reaches_the_child_and_its_deadline_fails_what_it_did_not_report(tmp_path):
    out, res = _run(tmp_path, "-k", "param", OWN_PROCESS_SLEEP="1", OWN_PROCESS_DEADLINE_S="6")
    assert set(res) == {"test_param[1]", "test_param[2]"}, res
    for name in res:
        kind, text = res[name]
        assert kind in ("failure", "error") and "ran past OWN_PROCESS_DEADLINE_S (6 s) and was killed" in text, (name, text)
