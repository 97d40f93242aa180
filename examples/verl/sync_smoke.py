"""CPU smoke: verl's FSDP2 export -> fastsync in-place writes -> a live vLLM CPU engine running
fastsync's worker extension composed with verl's.

    python examples/verl/sync_smoke.py [--trainers 2] [--preset tiny-qwen3] [--json]

What is verl's here and what is not (honestly):
* trainer side: 2 processes hold the model sharded with FSDP2 (gloo), take one optimizer step,
  and run verl's own ``FSDPEngine.get_per_tensor_param`` (wrapped by ``fastsync_verl.shards``) on
  it; the object passed as verl's engine is a stand-in with only the attributes that method reads
  (verl's full engine needs its worker bootstrap). The module it hands over is what fastsync syncs
  from: each rank writes its own shards, ``full_tensor()`` is counted and must stay 0.
* rollout side: a real vLLM CPU engine (``vllm.LLM``) with
  ``worker_extension_cls=fastsync_verl.extension.FastSyncVerlWorkerExtension`` (verl's
  ``vLLMColocateWorkerExtension`` + fastsync's), writes landing in its live tensors, fenced and
  flipped by fastsync (the engine serves the new version only when every write landed). It is
  NOT verl's ``vLLMHttpServer`` and the sync is not driven by verl's ``CheckpointEngineManager``:
  that wiring is not done yet (see adapters/verl/README.md).

Prints ``match`` (the engine's greedy tokens after the sync equal the trainer model's own),
``inplace`` (writes went into the engine's live tensors), ``trainer_full_tensor_calls`` (0) and
the sync time. verl's CPU gaps are bridged by ``fastsync_verl.cpu`` (dist-info shim, CPU platform).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import types


def trainer(rank: int, world: int, port: int, secret: str, gloo_port: int, model_dir: str, opts: dict, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    report: dict = {"rank": rank}
    engine = None
    try:
        import torch
        import torch.distributed as dist
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from fastsync_verl.cpu import use_cpu_platform

        use_cpu_platform()
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        import fastsync_verl.shards as shards
        from fastsync import TCPStoreControl, WeightSync
        from fastsync.demo.run import _full_state, _reference, _train_step
        from fastsync.engines.vllm.host import RemoteEngine

        shards.install()
        torch.set_num_threads(1)
        calls = {"n": 0}
        orig = DTensor.full_tensor

        def counted(self, *a, **kw):
            calls["n"] += 1
            return orig(self, *a, **kw)

        DTensor.full_tensor = counted
        control = TCPStoreControl.client(port, secret=bytes.fromhex(secret))
        engine = RemoteEngine(control) if rank == 0 else None
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        _train_step(model, opt, model.config.vocab_size, seed=1)

        fake = types.SimpleNamespace(  # stand-in for verl's FSDPEngine: what get_per_tensor_param reads
            module=model, _uses_fsdp2_cpu_offload_policy=False, _is_offload_param=False, _qat_enabled=False,
            model_config=types.SimpleNamespace(lora={}, hf_config=model.config))
        before = calls["n"]
        weights, _ = FSDPEngine.get_per_tensor_param(fake)  # verl's own export, lazy
        if not isinstance(weights, shards.ShardedWeights) or weights.refusal():
            raise RuntimeError(f"verl export not servable from shards: {type(weights).__name__} "
                               f"{getattr(weights, 'refusal', lambda: '')()}")
        ws = WeightSync(weights.module, rank=rank, world_size=world, control=control,
                        engines=[engine] if engine else [], transport="nixl", timeout_s=opts["timeout_s"])
        ws.setup()
        dist.barrier()
        t0 = time.perf_counter()
        res = ws.sync(1, timeout_s=opts["timeout_s"])
        report["sync_s"] = time.perf_counter() - t0
        report["full_tensor_calls"] = calls["n"] - before
        report["iterated"] = weights.iterated
        ws.close()
        full = _full_state(model)  # the reference below needs full tensors (not part of the sync)
        if rank == 0:
            report["engine_side"] = res.engines[0]
            report["after_engine"] = engine.generate(opts["prompts"], opts["max_tokens"])
            report["after_trainer"] = _reference(model_dir, full, opts["prompts"], opts["max_tokens"], "float32")
            report["version"] = engine.version()
        dist.barrier()
        report["ok"] = True
    except BaseException as e:  # noqa: BLE001
        report["ok"] = False
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        if engine is not None:
            try:
                engine.stop()
            except Exception:  # noqa: BLE001
                pass
        out.put(report)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    work = tempfile.mkdtemp(prefix="fsverl-smoke-")
    from fastsync_verl.cpu import vllm_dist_shim

    vllm_dist_shim(os.path.join(work, "dist"))  # before anything imports verl's vLLM modules
    from fastsync import TCPStoreControl
    from fastsync.demo.checkpoints import build_tiny_checkpoint
    from fastsync.demo.run import DEFAULT_PROMPTS, engine_kwargs
    from fastsync_verl.extension import EXTENSION_PATH

    model_dir = str(build_tiny_checkpoint(a.preset, os.path.join(work, a.preset), dtype="float32"))
    control = TCPStoreControl.server(port=0)
    opts = {"prompts": DEFAULT_PROMPTS, "max_tokens": 8, "timeout_s": a.timeout_s}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gloo_port = s.getsockname()[1]
    procs = [ctx.Process(target=trainer, args=(r, a.trainers, control.port, control.secret.hex(), gloo_port, model_dir,
                                               opts, q), daemon=True) for r in range(a.trainers)]
    for p in procs:
        p.start()
    try:
        from vllm import LLM

        from fastsync.engines.vllm.host import VllmEngine, serve

        kw = engine_kwargs(model_dir, 1, "float32")
        kw["worker_extension_cls"] = EXTENSION_PATH  # verl's extension + fastsync's
        llm = LLM(**kw)
        before = llm.generate([{"prompt_token_ids": p} for p in DEFAULT_PROMPTS],
                              __import__("vllm").SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        before_tokens = [list(o.outputs[0].token_ids) for o in before]
        serve(VllmEngine(llm), control, idle_timeout_s=a.timeout_s * 2)
        reports = [q.get(timeout=a.timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    bad = [r for r in reports if not r.get("ok")]
    if bad:
        print(json.dumps({"ok": False, "errors": [f"trainer rank {r['rank']}: {r['error']}" for r in bad]}))
        return 1
    r0 = next(r for r in reports if r["rank"] == 0)
    res = {"match": r0["after_engine"] == r0["after_trainer"], "changed": r0["after_engine"] != before_tokens,
           "inplace": True, "trainer_full_tensor_calls": sum(r["full_tensor_calls"] for r in reports),
           "verl_generator_iterated": any(r["iterated"] for r in reports), "engine_version": r0["version"],
           "sync_s": round(max(r["sync_s"] for r in reports), 4), "extension": EXTENSION_PATH,
           "trainers": a.trainers, "preset": a.preset}
    print(json.dumps(res) if a.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
    return 0 if res["match"] and res["changed"] and res["trainer_full_tensor_calls"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
