"""Ray across hosts (issue 20, part 5): a real multi-node Ray cluster, the head on one network-
namespace host and worker nodes on the others, with the trainer actors on one node and the vLLM
engine on another. The adapters' cross-node path: Ray node addresses, ``control_host`` (the
store on the trainer node's address), ``FASTSYNC_NET_DEVICES`` and the job secret reaching every
worker; the weights cross the trainer host's NIC (counted). verl's runs across hosts (two nodes,
and one TP=2 replica with a rank on each of two hosts taking the in-place path) are
``tests/adapters/test_verl_smoke.py``'s, which go across the rig wherever it can be made.
Bad ``--hosts`` and a process without the capability to make namespaces are refused before
anything starts, naming the flag or the capability."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastsync.transport import availability

needs_nixl = pytest.mark.skipif(not availability("nixl")[0], reason="NIXL is not importable here")

ROOT = Path(__file__).resolve().parents[2]
VERL = ROOT / "examples" / "verl" / "sync_smoke.py"
OPENRLHF = ROOT / "examples" / "openrlhf" / "cpu_smoke.py"


def _refused(cmd: list[str], prefix: list[str] | None = None) -> tuple[str, float]:
    t0 = time.monotonic()
    got = subprocess.run([*(prefix or []), sys.executable, *cmd], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2, (got.returncode, got.stdout[-2000:], got.stderr[-2000:])
    assert "ray" not in got.stdout.lower(), got.stdout[-2000:]  # nothing started: no Ray, no engine output
    return got.stderr, time.monotonic() - t0


def test_bad_hosts_flag_is_refused_before_anything_starts() -> None:
    err, took = _refused([str(VERL), "--hosts", "3", "--tp", "1"])
    assert "--hosts 3" in err and "--tp 1" in err and "divide" in err, err
    assert took < 60, took
    err, _ = _refused([str(VERL), "--hosts", "0"])
    assert "--hosts must be >= 1" in err, err
    err, _ = _refused([str(OPENRLHF), "--hosts", "3"])  # one engine, two trainer ranks: 2 hosts at most
    assert "--hosts" in err and "invalid choice" in err, err


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_no_namespace_capability_is_refused_naming_it(host_rig) -> None:  # host_rig: skips unless we could
    drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]  # this process, without capabilities
    for example in (VERL, OPENRLHF):
        err, took = _refused([str(example), "--hosts", "2"], prefix=drop)
        assert "--hosts 2" in err and "CAP_NET_ADMIN" in err, err
        assert took < 60, took


@needs_nixl
@pytest.mark.slow
def test_openrlhf_smoke_across_two_ray_nodes(host_rig) -> None:
    pytest.importorskip("openrlhf")
    got = subprocess.run([sys.executable, str(OPENRLHF), "--hosts", "2", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert got.returncode == 0 and "match: true" in got.stdout, (got.stdout[-3000:], got.stderr[-3000:])
    out = json.loads(got.stdout.strip().splitlines()[-1])
    # per sync: the trainers' transfer and how long the engine held generation back (the whole update:
    # OpenRLHF's engine is not staged), measured by the rollout actor around its update call
    assert out["match"] and len(out["syncs"]) == 2, out
    assert all(0 < s["engine_stall_seconds"] and 0 < s["transfer_s"] for s in out["syncs"]), out
    assert "trainers on 198.18.0.1, engine on 198.18.0.2" in got.stdout
    line = next(ln for ln in got.stdout.splitlines() if "trainer host NIC sent" in ln).split()
    sent, model = float(line[4]), float(line[7])
    assert sent > 2 * model, got.stdout  # both syncs' weights crossed the trainer host's NIC
