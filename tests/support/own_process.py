"""Engine tests that run in a pytest process of their own, with their vLLM engines in-process.

A test marked ``@pytest.mark.own_process`` (or a module with it in ``pytestmark``) is not run in
the pytest process (or xdist worker) that collected it. At the first such test of a module, that
process starts one child ``python -m pytest <the module's marked node ids>`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (and ``VLLM_CPU_OMP_THREADS_BIND=nobind``): each TP=1 engine
the tests start runs its engine core and worker inside the child (vLLM's uni executor, as vLLM's
own API tests run theirs) instead of spawning two processes that each import vLLM again (about
13 s of a 15 s engine start on these machines). The child's reports (pass, fail with its
traceback, skip, captured output, duration) are replayed as the tests' own, so ``-k``,
``--durations``, ``--junitxml`` and xdist see them as usual. Module-scoped fixtures are shared
inside the child as they would be here.

Why a child and not the collecting process: an in-process engine core changes its process for
good (vLLM's environment cache, ``torch.set_num_threads``, ``CPUWorker``'s bases), and vLLM 0.32's
kernel scan fails once another module has imported numba; a fresh child per module never carries
that into other tests (docs/development.md#tests).

The child gets a deadline (``OWN_PROCESS_DEADLINE_S``); past it, its process group is killed and
every test it had not reported fails naming the deadline. Tests that need vLLM's engine-core
process (pause modes ``keep``/``abort``, requests stepping while a sync runs, a killed worker,
engines that must not share a process) must not take the mark, nor may a module start an engine
after one of its tests imported numba (fastsync's delta): vLLM 0.32's kernel scan at a worker's
start fails on ``llvmlite.binding.ffi.lib`` then. TP=2 modules gain nothing (their workers are
processes either way): the LoRA and fallback modules took 128 s with it against 108 s without.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

MARK = "own_process"
#: set in the child: the file its reports go to (one JSON line each)
REPORTS_ENV = "OWN_PROCESS_REPORTS"
#: the child's whole run, every marked test of one module (the environment variable of the same
#: name overrides it)
OWN_PROCESS_DEADLINE_S = 1800.0
CHILD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: in the parent's session: each module's child run (``_run_child``), by module path
_RUNS = pytest.StashKey[dict]()

_config = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the child: each report to the parent's file."""
    path = os.environ.get(REPORTS_ENV)
    if not path or _config is None:
        return
    data = _config.hook.pytest_report_to_serializable(config=_config, report=report)
    with open(path, "a") as f:
        f.write(json.dumps(data, default=str) + "\n")


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _run_child(item: pytest.Item) -> dict:
    """Run every selected marked test of ``item``'s module in one child: ``reports`` (by node id),
    ``why`` a test without a full set of them failed, and the ``tail`` of the child's output."""
    ids = [i.nodeid for i in item.session.items
           if _module(i) == _module(item) and i.get_closest_marker(MARK) is not None]
    with tempfile.TemporaryDirectory(prefix="fs-own-") as tmp:
        reports, log = Path(tmp) / "reports.jsonl", Path(tmp) / "child.log"
        env = {**os.environ, **CHILD_ENV, REPORTS_ENV: str(reports)}
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                str(item.config.rootpath), *ids]
        deadline = float(os.environ.get("OWN_PROCESS_DEADLINE_S", OWN_PROCESS_DEADLINE_S))
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, cwd=item.config.invocation_params.dir, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=deadline)
                why = None
            except subprocess.TimeoutExpired:
                why = f"its child pytest ran past OWN_PROCESS_DEADLINE_S ({deadline:g} s) and was killed"
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
        got: dict[str, list[dict]] = {}
        if reports.exists():
            for line in reports.read_text().splitlines():
                data = json.loads(line)
                got.setdefault(data["nodeid"], []).append(data)
        tail = log.read_bytes()[-6000:].decode(errors="replace")
    if why is None:
        why = f"its child pytest exited with {proc.returncode} before reporting it"
    return {"reports": got, "why": why, "tail": tail}


def _tuples(data: dict) -> dict:
    """What JSON turned into lists back into the tuples pytest's reporters expect (a skip's
    ``longrepr``, ``location``, ``sections``, ``user_properties``)."""
    data = dict(data)
    data["location"] = tuple(data["location"])
    data["sections"] = [tuple(s) for s in data.get("sections", ())]
    data["user_properties"] = [tuple(p) for p in data.get("user_properties", ())]
    if isinstance(data.get("longrepr"), list):
        data["longrepr"] = tuple(data["longrepr"])
    return data


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """In the parent: a marked test's reports are its module child's (started at the module's first)."""
    if os.environ.get(REPORTS_ENV) or item.get_closest_marker(MARK) is None:
        return None
    module = _module(item)
    runs = item.session.stash.setdefault(_RUNS, {})
    if module not in runs:
        runs[module] = _run_child(item)
    run = runs[module]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    mine = run["reports"].get(item.nodeid, [])
    for data in mine:
        rep = item.config.hook.pytest_report_from_serializable(config=item.config, data=_tuples(data))
        item.ihook.pytest_runtest_logreport(report=rep)
    if not any(d["when"] == "teardown" for d in mine):  # the child stopped before this test's end
        when = "call" if any(d["when"] == "setup" for d in mine) else "setup"
        rep = pytest.TestReport(item.nodeid, item.location, {}, "failed",
                                f"{item.nodeid}: no {when} report from {run['why']}; its output ends:\n{run['tail']}",
                                when)
        item.ihook.pytest_runtest_logreport(report=rep)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    # what pytest's own protocol does at a test's end: tear down what ``nextitem`` does not share
    # (an unmarked test of this module set up the module here; the next module must not find it)
    item.session._setupstate.teardown_exact(nextitem)
    return True
