"""Time the layout model on real model sizes: inventory, name map, trainer and engine layouts.

    python -m fastsync.bench.layout                      # Kimi-K2: fsdp:256 -> vllm:tp8,dp4,ep,replicas4 fp8
    python -m fastsync.bench.layout --model deepseek-v3 --trainer hsdp:2x64 --rollout vllm:tp8,replicas4 --json

Prints one row per stage (seconds, best of ``--repeat``), tensor and piece counts; ``--json``
prints one JSON object instead. Figures, not assertions: tests never time anything.
"""

from __future__ import annotations

import argparse
import json
import time

from fastsync.layout.namemap import get_name_map
from fastsync.layout.spec import engine_layout_from_spec, trainer_layout_from_spec
from fastsync.models import load_inventory


def run(model: str, trainer: str, rollout: str, dtype_out: str, repeat: int) -> dict:
    best: dict[str, float] = {}
    out: dict = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        inv = load_inventory(model)
        t1 = time.perf_counter()
        nm = get_name_map(inv.architecture, inv.config, inv.params)
        t2 = time.perf_counter()
        tl = trainer_layout_from_spec(trainer, inv)
        t3 = time.perf_counter()
        el = engine_layout_from_spec(rollout, inv, dtype_out=dtype_out, name_map=nm)
        t4 = time.perf_counter()
        for key, val in (("inventory_s", t1 - t0), ("name_map_s", t2 - t1), ("trainer_layout_s", t3 - t2),
                         ("engine_layout_s", t4 - t3), ("total_s", t4 - t0)):
            best[key] = min(best.get(key, val), val)
        out = {
            "model": model,
            "trainer": trainer,
            "rollout": rollout,
            "dtype_out": dtype_out,
            "params": len(inv.params),
            "param_bytes": inv.nbytes,
            "engine_tensors": len(nm.params),
            "trainer_ranks": tl.world_size,
            "trainer_shards": sum(len(s) for s in tl.shards.values()),
            "engine_ranks": el.world_size,
            "engine_rank_tensors": sum(len(ts) for ts in el.tensors.values()),
            "engine_pieces": sum(len(t.pieces) for ts in el.tensors.values() for t in ts.values()),
            "engine_bytes": sum(t.nbytes for ts in el.tensors.values() for t in ts.values()),
        }
    out.update({k: round(v, 4) for k, v in best.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastsync.bench.layout", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--trainer", default="fsdp:256")
    ap.add_argument("--rollout", default="vllm:tp8,dp4,ep,replicas4")
    ap.add_argument("--dtype-out", default="fp8", choices=("bf16", "fp8"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(a.model, a.trainer, a.rollout, a.dtype_out, max(1, a.repeat))
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{res['model']}: {res['params']} params ({res['param_bytes'] / 1e9:.1f} GB), "
          f"{res['engine_tensors']} engine tensors")
    print(f"trainer {res['trainer']}: {res['trainer_ranks']} ranks, {res['trainer_shards']} shards")
    print(f"rollout {res['rollout']} ({res['dtype_out']}): {res['engine_ranks']} ranks, "
          f"{res['engine_rank_tensors']} rank tensors, {res['engine_pieces']} pieces, "
          f"{res['engine_bytes'] / 1e9:.1f} GB")
    print(f"{'stage':<18}{'seconds (best of ' + str(a.repeat) + ')':>26}")
    for key in ("inventory_s", "name_map_s", "trainer_layout_s", "engine_layout_s", "total_s"):
        print(f"{key.removesuffix('_s'):<18}{res[key]:>26.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
