"""A wheel built from the tree runs without the source checkout: installed into its own folder and
imported from there (the checkout is neither the working directory nor on the path), ``fastsync
plugins`` finds the built-ins through the wheel's entry points, ``fastsync bench`` syncs and
verifies across processes, ``fastsync demo`` syncs a real vLLM engine from it, and no CPU rig,
stand-in or adapter benchmark is in it (they live in tests/support and examples/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_runs_bench_and_demo_without_the_checkout(tmp_path) -> None:
    pytest.importorskip("nixl._api")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("fastsync_rl-*.whl"))
    site = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = tmp_path / "elsewhere"
    run.mkdir()

    def py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=run, env=env, capture_output=True, text=True, timeout=timeout)

    where = py("-c", "import fastsync, fastsync_verl, fastsync_openrlhf; "
               "print(fastsync.__file__); print(fastsync_verl.__file__); print(fastsync_openrlhf.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    lines = where.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith(str(site)) for line in lines), lines
    # test rigs stay out of the wheel: CPU rigs and stand-ins in tests/support, benchmarks in examples/
    rigs = [n for n in zipfile.ZipFile(wheel).namelist()
            if any(k in n for k in ("cpu_rig", "cpu_standins", "flash_attn", "fastsync_rigs", "/bench.py",
                                    "bench_trainer", "fastsync_verl/cpu.py", "fastsync/testing/"))]
    assert rigs == [], rigs
    plugins = py("-m", "fastsync.cli", "plugins", "--json")
    assert plugins.returncode == 0 and "builtin_transports" in plugins.stdout, plugins.stderr[-2000:]
    bench = py("-m", "fastsync.cli", "bench", "--trainers", "2", "--rollouts", "1", "--size-gb", "0.01", "--transport",
               "nixl", "--steps", "1", "--json", "--progress", "off", timeout=600)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert json.loads(bench.stdout)["transports"]["nixl"]["verified"] is True
    # the main job, from the wheel: a real vLLM engine, FSDP2 trainers, greedy tokens checked
    demo = py("-m", "fastsync.cli", "demo", "--preset", "tiny-qwen3", "--trainers", "2", "--repeats", "1",
              "--no-baseline", "--workdir", str(tmp_path / "ckpt"), "--json", timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    # vLLM's processes log to stdout too: the report is the line that is fastsync's JSON object
    reports = [json.loads(x) for x in demo.stdout.splitlines() if x.startswith('{"summary"')]
    assert len(reports) == 1, demo.stdout[-3000:]
    summary = reports[0]["summary"]
    assert summary["match"] is True and summary["changed"] is True, summary
