"""OpenRLHF's weight-sync pattern vs fastsync, same model, real processes (CPU host).

    python examples/openrlhf/bench.py [--model tiny|small] [--syncs N] [--json]

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
* ``fastsync``: ``fastsync.DeepSpeedWeightSync`` (what the adapter runs): the plan comes from the ZeRO-3 partitions
  (``zero3:2``), every rank WRITEs its own partitions, nothing is gathered.

``verified``: after each sync (off the clock) the engine serves that sync's version
(``flipped_syncs``), and after the path's last sync (and a real training step before the path,
so the weights changed) the engine's greedy tokens equal the trainer model's own.

On GPU the real comparison is OpenRLHF's own NCCL path: ``examples/openrlhf/grpo_gpu.sh``. This
is a CPU measurement on the test rig (``tests/support/fastsync_rigs``: its stand-ins are named
there), so it lives with the examples, not in the wheel.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))  # the CPU rig (not in the wheel)
from fastsync_rigs import STANDINS  # noqa: E402
from fastsync_rigs.openrlhf_cpu import CpuRig, TrainerRank, build_checkpoint, postprocess_s  # noqa: E402

__all__ = ["run", "main", "MODELS"]

MODELS = {
    "tiny": None,  # openrlhf_cpu.AWKWARD_QWEN3 (~1 MB)
    # ~51M parameters (~205 MB fp32), awkward hidden/intermediate sizes
    "small": {"vocab_size": 4096, "hidden_size": 1000, "intermediate_size": 2744, "num_hidden_layers": 4,
              "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.05, "bos_token_id": 1,
              "eos_token_id": 2},
}


def _standin_path() -> str:
    """The flash_attn STAND-IN's folder when the real package is absent (a CPU host)."""
    try:
        import flash_attn  # noqa: F401

        return ""
    except ImportError:
        return STANDINS


def _handles(actors: list) -> list:
    """The rollout actors as engine handles whose workers join the control plane on loopback."""
    from fastsync import RpcEngine

    return [RpcEngine.over_ray(a, name=f"vLLM engine {i}", timeout_s=120.0,
                               connect_options={"control_host": "127.0.0.1"}) for i, a in enumerate(actors)]


class BenchRank(TrainerRank):
    """A rig trainer rank that also runs the two timed paths without OpenRLHF's classes."""

    def fastsync_setup(self, engines: list, transport: str = "nixl") -> float:
        from fastsync import DeepSpeedWeightSync

        self.sync = DeepSpeedWeightSync(self.engine.module, engines=_handles(engines), zero_stage=3,
                                        transport=transport, control_host="127.0.0.1", name="bench")
        self.sync.setup()
        return self.sync.setup_s

    def fastsync_sync(self, version: int) -> tuple[float, float, float]:
        """(seconds of the whole sync, 0 gather seconds, the engine's post-load repack seconds)."""
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        res = self.sync.sync(version)  # versions shared with the other path on the same engine
        dist.barrier()
        return time.perf_counter() - t0, 0.0, postprocess_s(res)

    def pattern_setup(self, engines: list) -> None:
        """OpenRLHF's pattern: rank 0 alone sends full tensors (a one-rank 'trainer world' holding
        every parameter whole, filled by per-parameter ``GatheredParameters`` at each sync)."""
        import torch

        from fastsync import ParamSpec, TCPStoreControl, WeightSync, replicated_layout

        if self.rank != 0:
            return
        params = dict(self.engine.module.named_parameters())
        self.holder = {n: torch.empty(tuple(p.ds_shape), dtype=p.dtype) for n, p in params.items()}
        for t in self.holder.values():
            t.view(-1).view(torch.uint8).zero_()  # touched once
        specs = {n: ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in self.holder.items()}
        self.pattern_control = TCPStoreControl.server(port=0, host="127.0.0.1")
        self.pattern = WeightSync(rank=0, world_size=1, control=self.pattern_control.with_prefix("pattern"),
                                  engines=_handles(engines),
                                  transport="nixl", timeout_s=120.0, layout=replicated_layout(specs, 1),
                                  sources=self.holder, name="pattern", control_port=self.pattern_control.port)
        self.pattern.setup()

    def pattern_sync(self, version: int) -> tuple[float, float, float]:
        """(seconds of the whole sync, of the per-parameter gathers, of the engine's repack)."""
        import deepspeed
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        for name, p in self.engine.module.named_parameters():  # OpenRLHF: one parameter at a time
            with deepspeed.zero.GatheredParameters([p]):
                if self.rank == 0:
                    self.holder[name].copy_(p.data)
        gather_s = time.perf_counter() - t0
        res = self.pattern.sync(version) if self.rank == 0 else None
        dist.barrier()
        return time.perf_counter() - t0, gather_s, postprocess_s(res)


def run(model: str = "small", syncs: int = 5, num_trainers: int = 2) -> dict:
    import ray

    work = tempfile.mkdtemp(prefix="fastsync-openrlhf-bench-")
    model_dir = build_checkpoint(os.path.join(work, "ckpt"), MODELS[model])
    rig = CpuRig(model_dir, os.path.join(work, "ray"), num_trainers=num_trainers,
                 env={"PYTHONPATH": _standin_path()}, rank_cls=BenchRank)
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
            times, gathers, repacks, flipped = [], [], [], []
            for _ in range(syncs):
                version += 1
                got = ray.get([getattr(t, fn).remote(version) for t in rig.trainers], timeout=300)
                times.append(max(g[0] for g in got))
                gathers.append(max(g[1] for g in got))
                repacks.append(max(g[2] for g in got))
                flipped.append(rig.engine_version() == [version])  # after the clock: every sync flipped
            want = rig.trainer_tokens()
            got = rig.engine_tokens()
            verified = got == want and all(flipped)
            if not verified:
                out.setdefault("mismatch", {})[path] = {"engine": got, "trainer": want,
                                                        "engine_version": rig.engine_version()}
            out["paths"][path] = {"seconds_median": round(statistics.median(times), 4),
                                  "seconds": [round(t, 4) for t in times], "setup_s": round(setup_s, 2),
                                  "verified": verified, "flipped_syncs": f"{sum(flipped)}/{syncs}"}
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
    ap = argparse.ArgumentParser(prog="python examples/openrlhf/bench.py", description=__doc__.splitlines()[0])
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
