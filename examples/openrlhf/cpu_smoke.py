"""CPU smoke test of the OpenRLHF adapter: real parts, no GPU.

    python examples/openrlhf/cpu_smoke.py          # prints "match: true" when the sync worked
    python examples/openrlhf/cpu_smoke.py --json   # the same, as one JSON object (per sync: transfer, stall)
    python examples/openrlhf/cpu_smoke.py --hosts 2  # trainers and engine on two Ray nodes (namespace hosts)

Ray with a logical GPU, OpenRLHF's ``RolloutRayActor`` (fastsync's subclass) running the vLLM
CPU engine, 2 DeepSpeed ZeRO-3 ranks over gloo (the test rig, ``tests/support/fastsync_rigs/openrlhf_cpu.py``). Two real
training steps; after each, the adapter's ``broadcast_to_vllm`` on every rank, then the engine's
greedy tokens are compared with the trainer model's. ``flash_attn`` does not install on CPU:
when it is missing, this script puts the test suite's STAND-IN (tests/support/fastsync_rigs/standins,
pure-torch padding helpers only) on the path, for OpenRLHF's top-level import.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _paths() -> str:
    extra = [str(REPO), str(REPO / "adapters" / "openrlhf"), str(REPO / "tests" / "support")]
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        extra.insert(0, str(REPO / "tests" / "support" / "fastsync_rigs" / "standins"))  # STAND-IN, see docstring
    sys.path[:0] = extra
    return os.pathsep.join(extra)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                    help="2: a real two-node Ray cluster on network-namespace hosts of this machine (root / "
                         "CAP_NET_ADMIN), the DeepSpeed ranks on one, the vLLM engine on the other")
    ap.add_argument("--nic-gbps", type=float, default=2.0, help="with --hosts 2: each host's NIC rate")
    ap.add_argument("--json", action="store_true", help="print one JSON object (per sync: transfer_s, "
                    "engine_stall_seconds) after the lines")
    a = ap.parse_args(argv)
    pythonpath = _paths()
    from fastsync_rigs.openrlhf_cpu import CpuRig, build_checkpoint

    hosts = None
    if a.hosts == 2:
        from fastsync.bench.netns import rig_unavailable
        from fastsync.bench.netns_cluster import HostRig, check_shape

        why = rig_unavailable()
        if why is not None:
            print(f"--hosts 2: {why}", file=sys.stderr)
            return 2
        check_shape(2, a.nic_gbps)
        hosts = HostRig(2, a.nic_gbps)
    work = tempfile.mkdtemp(prefix="fastsync-openrlhf-smoke-", dir="/tmp")
    try:
        return _run(work, pythonpath, hosts, a.json)
    finally:
        if hosts is not None:
            hosts.close()
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint and Ray's session folder: nothing is kept


def _run(work: str, pythonpath: str, hosts, as_json: bool = False) -> int:
    from fastsync_rigs.openrlhf_cpu import CpuRig, build_checkpoint

    rig = CpuRig(build_checkpoint(os.path.join(work, "ckpt")), os.path.join(work, "ray"), num_trainers=2,
                 env={"PYTHONPATH": pythonpath}, hosts=hosts)
    ok = True
    syncs: list[dict] = []
    nic0 = hosts.nic_bytes(0)[0] if hosts is not None else 0
    try:
        if hosts is not None:
            print(f"ray nodes: trainers on {hosts.addr(0)}, engine on {hosts.addr(1)}")
        print(f"engine + 2 DeepSpeed ZeRO-3 ranks started in {rig.start_s:.1f} s")
        for t in rig.make_trainers():
            print(f"trainer worker pid {t['pid']}: ppo_actor.ActorPPOTrainer = {t['ActorPPOTrainer']}")
        for step in (1, 2):
            loss = rig.train_step(seed=step)[0]
            want = rig.trainer_tokens()
            res = rig.broadcast_to_vllm()
            got = rig.engine_tokens()
            # OpenRLHF's engine is not staged: its update holds generation for the whole transfer
            stall = next(r["engine_stall_seconds"] for r in res if r["rank"] == 0)
            syncs.append({"version": res[0]["version"], "transfer_s": max(r["sync_s"] for r in res),
                          "engine_stall_seconds": stall, "requests_in_flight": 0, "match": got == want})
            print(f"step {step}: loss {loss:.3f}, broadcast_to_vllm {max(r['seconds'] for r in res):.3f} s "
                  f"(version {res[0]['version']}, engine stalled {stall:.3f} s), engine tokens == trainer tokens: "
                  f"{got == want}")
            ok = ok and got == want
        if hosts is not None:
            model_mb = sum(p.stat().st_size for p in Path(rig.model_dir).glob("*.safetensors")) / 1e6
            print(f"trainer host NIC sent {(hosts.nic_bytes(0)[0] - nic0) / 1e6:.1f} MB (model {model_mb:.1f} MB)")
    finally:
        rig.close()
    print(f"match: {str(ok).lower()}")
    if as_json:
        import json

        print(json.dumps({"match": ok, "syncs": syncs}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
