"""The GPU check's parts that need no GPU: deadlines, the report, the wheel list and trimming, the
entry-point metadata, the dry run of scripts/gpu_check.sh, and a CPU rehearsal of every part.

Nothing here is a stand-in for CUDA: the CUDA paths themselves run only on a lent GPU machine
(README "GPU check"); what is tested is everything around them, for real (pip, NIXL on DRAM,
spawned processes, pytest)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch

from fastsync.errors import ConfigError
from fastsync.gpu.check import gpu_test_files
from fastsync.gpu.report import (
    EXIT_CODES, assemble, installed_dists, read_wheel_list, run_part, summary_lines, write_entry_points,
)
from fastsync.gpu.wheels import trim_wheel

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters" / "verl"), env.get("PYTHONPATH", "")])
    return env


def _script(tmp: Path, name: str, body: str) -> list[str]:
    path = tmp / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_run_part_statuses_and_deadline_kills_the_whole_group(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    res = tmp_path / "res.json"
    ok = _script(tmp_path, "ok", f"""
        import json; print("working"); json.dump({{"ok": True, "x": 3}}, open({str(res)!r}, "w"))""")
    got = run_part("a", ok, 30, res, log)
    assert got["status"] == "ok" and got["result"]["x"] == 3 and got["error"] is None

    bad = _script(tmp_path, "bad", f"""
        import json, sys; json.dump({{"ok": False, "error": "bytes differ"}}, open({str(res)!r}, "w")); sys.exit(1)""")
    got = run_part("b", bad, 30, res, log)
    assert got["status"] == "failed" and got["error"] == "bytes differ" and got["exit_code"] == 1

    silent = _script(tmp_path, "silent", "pass")
    got = run_part("c", silent, 30, res, log)
    assert got["status"] == "failed" and "without writing" in got["error"]

    pidfile = tmp_path / "child.pid"
    hang = _script(tmp_path, "hang", f"""
        import json, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        json.dump({{"ok": False, "partial": 1}}, open({str(res)!r}, "w"))
        time.sleep(600)""")
    t0 = time.monotonic()
    got = run_part("d", hang, 3, res, log)
    assert got["status"] == "timeout" and "3 s deadline" in got["error"]
    assert got["result"] == {"ok": False, "partial": 1}  # what it wrote before the deadline is kept
    assert time.monotonic() - t0 < 20
    child = int(pidfile.read_text())
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "the part's own child outlived the deadline"
    text = log.read_text()
    assert "=== part a" in text and "working" in text and "=== part d" in text

    with pytest.raises(ConfigError, match="part 'e'"):
        run_part("e", ok, 0, res, log)


def test_assemble_reports_first_failure_and_lifts_figures() -> None:
    sync = {"bf16": {"nixl": {"gbps": 120.0}, "rank0": {"gbps": 3.0}, "nixl_vs_rank0": 40.0},
            "device_copy": {"gbps": 2000.0}}
    parts = {
        "sync": {"status": "ok", "seconds": 1.0, "exit_code": 0, "error": None, "result": sync},
        "moe": {"status": "timeout", "seconds": 9.0, "exit_code": -9, "error": "killed at its 9 s deadline",
                "result": None},
        "gpu_tests": {"status": "skipped", "seconds": 0, "exit_code": None, "error": "dry run", "result": None},
    }
    rep = assemble(parts=parts, env={"device": "x"}, wheels=[], dry_run=False, started="t", wall_s=3.14159)
    assert rep["ok"] is False
    assert rep["error"].startswith("part 'moe' timeout")
    assert rep["summary"]["nixl_gbps"] == 120.0 and rep["summary"]["nixl_vs_rank0"] == 40.0
    assert rep["summary"]["device_copy_gbps"] == 2000.0 and rep["summary"]["moe_fastsync_vs_hf_eager"] is None
    assert rep["wall_s"] == 3.14
    json.dumps(rep)  # one JSON object

    assert rep["verdict"] == "failed" and rep["summary"]["parts"] == {"passed": 1, "skipped": 1, "failed": 1}

    parts["moe"]["status"] = "ok"
    rep = assemble(parts=parts, env={}, wheels=[], dry_run=False, started="t", wall_s=0)
    assert rep["ok"] is True  # nothing failed ...
    assert rep["verdict"] == "passed_with_skips"  # ... but a skipped part is not a pass
    assert rep["summary"]["part_names"]["skipped"] == ["gpu_tests"]
    rep = assemble(parts={}, env={}, wheels=[], dry_run=True, started="t", wall_s=0, error="no CUDA device: x")
    assert rep["ok"] is False and rep["error"] == "no CUDA device: x" and rep["verdict"] == "not_run"
    parts["moe"]["status"] = "fine"
    with pytest.raises(ConfigError, match="part 'moe'"):
        assemble(parts=parts, env={}, wheels=[], dry_run=False, started="t", wall_s=0)


def _tests_part(passed: int, skipped: int, failed: int = 0) -> dict:
    cases = ([{"name": f"t::p{i}", "outcome": "passed", "message": ""} for i in range(passed)]
             + [{"name": f"t::s{i}", "outcome": "skipped", "message": f"needs thing {i}"} for i in range(skipped)]
             + [{"name": f"t::f{i}", "outcome": "failed", "message": "boom"} for i in range(failed)])
    res = {"ok": not failed, "passed": passed, "skipped": skipped, "failed": failed, "errors": 0, "cases": cases}
    status = "failed" if failed else ("skipped" if skipped and not passed else "ok")
    return {"status": status, "seconds": 1.0, "exit_code": 1 if failed else 0,
            "error": "pytest exit 1" if failed else None, "result": res}


def _ok_part() -> dict:
    return {"status": "ok", "seconds": 1.0, "exit_code": 0, "error": None, "result": {"ok": True}}


def test_skips_are_counted_apart_and_never_called_a_pass() -> None:
    """Summary and verdict of the GPU check: passed / skipped / failed each counted on their own, a
    skipped test or part makes the verdict "passed_with_skips" (exit 3), never "passed"."""
    def rep(**parts: dict) -> dict:
        return assemble(parts=parts, env={}, wheels=[], dry_run=False, started="t", wall_s=0)

    full = rep(sync=_ok_part(), gpu_tests=_tests_part(3, 0))
    assert full["verdict"] == "passed" and EXIT_CODES[full["verdict"]] == 0
    assert full["summary"]["gpu_tests"] == {"passed": 3, "skipped": 0, "failed": 0, "errors": 0, "skipped_tests": []}
    assert summary_lines(full)[-1].startswith("verdict: passed (")

    some = rep(sync=_ok_part(), gpu_tests=_tests_part(3, 2))
    assert some["ok"] is True and some["verdict"] == "passed_with_skips" and EXIT_CODES["passed_with_skips"] == 3
    t = some["summary"]["gpu_tests"]
    assert (t["passed"], t["skipped"], t["failed"]) == (3, 2, 0)
    assert t["skipped_tests"] == [{"name": "t::s0", "reason": "needs thing 0"}, {"name": "t::s1", "reason": "needs thing 1"}]
    lines = summary_lines(some)
    assert "parts: 2 passed, 0 skipped, 0 failed" in lines
    assert "gpu tests: 3 passed, 2 skipped, 0 failed, 0 errors" in lines
    assert "  skipped t::s1: needs thing 1" in lines
    assert "PASSED WITH SKIPS" in lines[-1] and "not checked" in lines[-1]
    assert not any(line.startswith("verdict: passed (") for line in lines)

    none_ran = rep(sync=_ok_part(), gpu_tests=_tests_part(0, 4))
    assert none_ran["summary"]["parts"] == {"passed": 1, "skipped": 1, "failed": 0}
    assert none_ran["verdict"] == "passed_with_skips"
    assert rep(gpu_tests=_tests_part(0, 4))["verdict"] == "not_run"  # nothing at all passed

    bad = rep(sync=_ok_part(), gpu_tests=_tests_part(3, 2, failed=1))
    assert bad["ok"] is False and bad["verdict"] == "failed" and EXIT_CODES["failed"] == 1
    assert "gpu tests: 3 passed, 2 skipped, 1 failed, 0 errors" in summary_lines(bad)

    dry = assemble(parts={"sync": {"status": "skipped", "seconds": 0.0, "exit_code": None, "error": "dry run",
                                   "result": None}}, env={}, wheels=[], dry_run=True, started="t", wall_s=0)
    assert dry["verdict"] == "not_run" and "dry run" in summary_lines(dry)[-1]


def test_run_part_takes_a_part_that_says_skipped(tmp_path: Path) -> None:
    res = tmp_path / "res.json"
    script = _script(tmp_path, "skip", f"""
        import json; json.dump({{"ok": True, "status": "skipped", "reason": "no second GPU"}}, open({str(res)!r}, "w"))""")
    got = run_part("s", script, 30, res, tmp_path / "log.txt")
    assert got["status"] == "skipped" and got["error"] == "no second GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks how the gpu tests' skips are counted without CUDA")
def test_gpu_tests_part_counts_its_skips(tmp_path: Path) -> None:
    """The real gpu_tests part (pytest over the gpu-marked files, outcomes from JUnit XML) on this
    CPU machine: every test skips, so the part is "skipped", each test counted and listed with its
    reason, none counted as passed."""
    res = tmp_path / "part_gpu_tests.json"
    got = run_part("gpu_tests", [sys.executable, "-m", "fastsync.gpu.check", "--run-gpu-tests", "--out", str(res)],
                   300, res, tmp_path / "log.txt", env=_env(), cwd=str(ROOT))
    assert got["status"] == "skipped", (tmp_path / "log.txt").read_text()[-3000:]
    r = got["result"]
    assert r["passed"] == 0 and r["failed"] == 0 and r["errors"] == 0 and r["skipped"] >= 4
    assert got["error"] == f"all {r['skipped']} gpu-marked tests skipped"
    rep = assemble(parts={"gpu_tests": got}, env={}, wheels=[], dry_run=False, started="t", wall_s=0)
    skipped = rep["summary"]["gpu_tests"]["skipped_tests"]
    assert len(skipped) == r["skipped"] and all(c["reason"] for c in skipped)
    assert any(c["name"].endswith("test_deepep_dispatch_matches_all_to_all") for c in skipped)
    assert rep["verdict"] == "not_run"


def test_wheel_list_is_pinned_and_matches_the_cpu_nixl(tmp_path: Path) -> None:
    pins = dict(read_wheel_list(ROOT / "scripts" / "gpu_wheels.txt"))
    lock = dict(line.split("==") for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["nixl-cu13"] == pins["nixl"]  # the meta package requires its backend at the same version
    assert pins["nixl"] == "1.5.1"  # the version the CPU side runs (Makefile installs nixl==1.5.1)
    assert pins["pytest-timeout"] == lock["pytest-timeout"]
    bad = tmp_path / "w.txt"
    bad.write_text("nixl==1.5.1\n# fine\n\nnixl-cu13>=1.5\n")
    with pytest.raises(ConfigError, match=r"w.txt:4: 'nixl-cu13>=1.5'"):
        read_wheel_list(bad)


def _toy_wheel(dest: Path, name: str = "toy_pkg", extra: dict[str, bytes] | None = None) -> Path:
    files = {f"{name}/__init__.py": b"VALUE = 7\n", **(extra or {})}
    dist = f"{name}-0.1.dist-info"
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    rows = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
            for n, d in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join(rows + [f"{dist}/RECORD,,"]) + "\n").encode()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return path


def test_trimmed_wheel_keeps_a_consistent_record_and_installs(tmp_path: Path) -> None:
    big = os.urandom(200_000)
    whl = _toy_wheel(tmp_path / "w", extra={"toy_pkg_ep/kernels.so": big, "toy_pkg/libs/perftest.so": big,
                                             "toy_pkg/libs/keep.so": b"keep"})
    before, after = trim_wheel(whl, ("toy_pkg_ep/", "toy_pkg/libs/perftest"))
    assert after < before - 300_000
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        record = z.read("toy_pkg-0.1.dist-info/RECORD").decode()
    assert "toy_pkg_ep/kernels.so" not in names and "toy_pkg/libs/perftest.so" not in names
    assert "toy_pkg/libs/keep.so" in names and "toy_pkg/libs/keep.so," in record and "perftest" not in record
    with pytest.raises(ConfigError, match="nothing under"):
        trim_wheel(whl, ("not_there/",))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--target", str(site), str(whl)], check=True, timeout=300)
    assert (site / "toy_pkg" / "libs" / "keep.so").read_bytes() == b"keep"
    assert installed_dists(site) == [{"name": "toy-pkg", "version": "0.1"}]


def test_entry_points_metadata_lists_the_builtins(tmp_path: Path) -> None:
    import importlib.metadata as md
    import tomllib

    write_entry_points(ROOT / "pyproject.toml", tmp_path)
    (dist,) = list(md.distributions(path=[str(tmp_path)]))
    got = {ep.name: ep.value for ep in dist.entry_points if ep.group == "fastsync"}
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["fastsync"]
    assert got == want and "builtin_transports" in got
    empty = tmp_path / "p.toml"
    empty.write_text('[project]\nname = "x"\nversion = "1"\n')
    with pytest.raises(ConfigError, match="entry-points.fastsync"):
        write_entry_points(empty, tmp_path / "other")


def test_gpu_marked_files_are_found() -> None:
    files = gpu_test_files(ROOT)
    assert "tests/moe/test_moe_gpu.py" in files
    assert all("pytest.mark.gpu" in (ROOT / f).read_text() for f in files)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_dry_run_installs_reports_and_fails_for_want_of_cuda(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _toy_wheel(wheels)
    out = tmp_path / "out"
    env = {**_env(), "GPU_CHECK_WHEELS": str(wheels), "GPU_CHECK_SITE": str(tmp_path / "site"),
           "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_DRY": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["ok"] is False and rep["dry_run"] is True and rep["verdict"] == "not_run"
    assert rep["error"].startswith("no CUDA device")
    assert {"name": "toy-pkg", "version": "0.1"} in rep["wheels"]
    assert any(w["name"] == "fastsync-rl" for w in rep["wheels"])  # the entry-point metadata went in
    assert rep["parts"] == {} and rep["env"]["torch"] == torch.__version__
    log = (out / "gpu_check.log").read_text()
    assert "installing 1 wheel(s)" in log and "no CUDA device" in log


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_part(tmp_path: Path) -> None:
    """Every part's code, spawned and reported as on the GPU machine, on the CPU at toy sizes:
    NIXL (DRAM) vs rank0 with CRC verification, the FP8 sender, the MoE variants' equivalence,
    the gpu-marked tests (all skipped here, and counted)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fastsync.gpu.check", str(out), "--cpu-rehearsal"], env=_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    rep = json.loads((out / "gpu_check.json").read_text())
    # every gpu test skips here: nothing failed (ok), but the check does not call that a pass (exit 3)
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:] + (out / "gpu_check.log").read_text()[-3000:]
    assert rep["ok"] and rep["verdict"] == "passed_with_skips" and rep["env"]["cpu_rehearsal"] is True
    assert {n: p["status"] for n, p in rep["parts"].items()} == {"sync": "ok", "moe": "ok", "gpu_tests": "skipped"}
    assert "PASSED WITH SKIPS" in proc.stdout and "parts: 2 passed, 1 skipped, 0 failed" in proc.stdout
    sync = rep["parts"]["sync"]["result"]
    assert sync["bf16"]["nixl"]["verified"] is True and sync["bf16"]["rank0"]["verified"] is True
    assert sync["fp8"]["nixl"]["verified"] is True and sync["device_copy"]["verified"] is True
    assert rep["summary"]["nixl_gbps"] > 0 and rep["summary"]["nixl_vs_rank0"] > 0
    moe = rep["parts"]["moe"]["result"]
    assert moe["main"]["fastsync"]["max_rel_err"] < 1e-3 and moe["main"]["fastsync"]["kernel"]
    tests = rep["parts"]["gpu_tests"]["result"]
    assert tests["failed"] == 0 and tests["errors"] == 0 and tests["skipped"] >= 1
