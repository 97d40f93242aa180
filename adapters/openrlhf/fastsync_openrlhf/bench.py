"""OpenRLHF's weight-sync pattern vs fastsync, same model, real processes (CPU host).

    python -m fastsync_openrlhf.bench [--model tiny|small] [--syncs N] [--json]

One vLLM CPU engine inside fastsync's ``RolloutRayActor`` subclass and 2 DeepSpeed ZeRO-3 ranks
(Ray actors, gloo), as in the adapter's test. Two paths, each set up once and then timed over
``--syncs`` syncs (the median is reported; every rank waits at a barrier before and after):

* ``openrlhf_pattern``: what OpenRLHF 0.11.2's ``broadcast_to_vllm`` does: every rank runs
  ``deepspeed.zero.GatheredParameters`` on one parameter at a time (each gets the full tensor)
  and only rank 0 sends: here rank 0 is a one-rank fastsync "trainer world" holding the full
  tensors and WRITEs them into the engine. OpenRLHF's NCCL broadcast and its per-parameter
  ``ray.get`` cannot run on CPU, and fastsync's ``rank0`` transport needs the default
  torch.distributed group to span trainers and engine workers (DeepSpeed and vLLM each own
  theirs), so rank 0's send uses NIXL: this favours the baseline (no per-parameter round trip).
* ``fastsync``: the adapter's ``DeepSpeedWeightSync``: the plan comes from the ZeRO-3 partitions
  (``zero3:2``), every rank WRITEs its own partitions, nothing is gathered.

``verified``: after the path's last sync (and a real training step before the path, so the
weights changed), the engine's greedy tokens equal the trainer model's own.

On GPU the real comparison is OpenRLHF's own NCCL path: ``examples/openrlhf/grpo_gpu.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run", "main", "MODELS"]

MODELS = {
    "tiny": None,  # cpu_rig.AWKWARD_QWEN3 (~1 MB)
    # ~51M parameters (~205 MB fp32), awkward hidden/intermediate sizes
    "small": {"vocab_size": 4096, "hidden_size": 1000, "intermediate_size": 2744, "num_hidden_layers": 4,
              "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.05, "bos_token_id": 1,
              "eos_token_id": 2},
}


def _standin_path() -> str:
    """The flash_attn STAND-IN shipped with the adapter (``cpu_standins``), when the real one is
    absent: the package's own copy, so the benchmark runs from an installed wheel."""
    try:
        import flash_attn  # noqa: F401

        return ""
    except ImportError:
        from fastsync_openrlhf.cpu_standins import PATH

        return PATH


def run(model: str = "small", syncs: int = 5, num_trainers: int = 2) -> dict:
    import ray

    from fastsync_openrlhf.cpu_rig import CpuRig, build_checkpoint

    work = tempfile.mkdtemp(prefix="fastsync-openrlhf-bench-")
    model_dir = build_checkpoint(os.path.join(work, "ckpt"), MODELS[model])
    rig = CpuRig(model_dir, os.path.join(work, "ray"), num_trainers=num_trainers,
                 env={"PYTHONPATH": _standin_path()})
    out: dict = {"model": model, "trainers": num_trainers, "syncs": syncs, "engine_start_s": round(rig.start_s, 2),
                 "paths": {}}
    try:
        nbytes = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
        out["model_bytes"] = nbytes
        version = 0
        for step, path in enumerate(("openrlhf_pattern", "fastsync"), start=1):
            rig.train_step(seed=step)
            t0 = time.perf_counter()
            if path == "fastsync":
                ray.get([t.fastsync_setup.remote([rig.engine]) for t in rig.trainers], timeout=300)
                fn = "fastsync_sync"
            else:
                ray.get([t.pattern_setup.remote([rig.engine]) for t in rig.trainers], timeout=300)
                fn = "pattern_sync"
            setup_s = time.perf_counter() - t0
            times, gathers, repacks = [], [], []
            for _ in range(syncs):
                version += 1
                got = ray.get([getattr(t, fn).remote(version) for t in rig.trainers], timeout=300)
                times.append(max(g[0] for g in got))
                gathers.append(max(g[1] for g in got))
                repacks.append(max(g[2] for g in got))
            want = rig.trainer_tokens()
            got = rig.engine_tokens()
            verified = got == want and rig.engine_version() == [version]
            if not verified:
                out.setdefault("mismatch", {})[path] = {"engine": got, "trainer": want,
                                                        "engine_version": rig.engine_version()}
            out["paths"][path] = {"seconds_median": round(statistics.median(times), 4),
                                  "seconds": [round(t, 4) for t in times], "setup_s": round(setup_s, 2),
                                  "verified": verified}
            # of which: the per-parameter GatheredParameters loop (pattern only), and the engine's
            # post-load repack at the flip (vLLM CPU repacks linear weights; both paths pay it)
            out["paths"][path]["gather_s_median"] = round(statistics.median(gathers), 4)
            out["paths"][path]["engine_repack_s_median"] = round(statistics.median(repacks), 4)
        fs, base = out["paths"]["fastsync"]["seconds_median"], out["paths"]["openrlhf_pattern"]["seconds_median"]
        out["speedup"] = round(base / fs, 2) if fs > 0 else None
        out["load_avg"] = os.getloadavg()[0]
    finally:
        rig.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastsync_openrlhf.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.syncs < 1:
        ap.error("--syncs must be at least 1")
    # DeepSpeed and vLLM log to stdout: keep it for the result (fd level, so child output too)
    saved = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    try:
        res = run(a.model, a.syncs, a.trainers)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"OpenRLHF sync, {a.trainers} DeepSpeed ZeRO-3 ranks -> 1 vLLM CPU engine, model {a.model} "
              f"({res['model_bytes'] / 2**20:.0f} MiB), {a.syncs} syncs per path")
        print(f"{'path':<18}{'median s':>10}{'gather s':>10}{'repack s':>10}{'setup s':>10}{'verified':>10}")
        for name, p in res["paths"].items():
            print(f"{name:<18}{p['seconds_median']:>10.4f}{p['gather_s_median']:>10.4f}"
                  f"{p['engine_repack_s_median']:>10.4f}{p['setup_s']:>10.2f}{str(p['verified']):>10}")
        print(f"speed-up (openrlhf_pattern / fastsync): {res['speedup']}x")
    ok = all(p["verified"] for p in res["paths"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
