"""``fastsync delta-bench``: how much of a model really changes per RL optimizer step, and what a
delta sync saves over a dense one, measured end to end.

One trainer process holds a real HF transformers model (fp32 master weights, random init, or
a checkpoint when ``--model DIR`` holds weights) and runs real AdamW steps (forward and backward
of a causal-LM loss on seeded token batches); ``--rollouts`` engine processes hold the model the
way a vLLM TP engine does (bf16, fused ``qkv_proj``/``gate_up_proj``, through the vLLM name map).
After every optimizer step the trainer syncs the same weights twice over NIXL: first as a delta
(against the version the engines hold), then dense (the ordinary planned writes), each timed
from the moment every process passed a barrier to the last engine's flip. After each sync every
engine rank compares CRCs of all its tensors with those the trainer computes independently from
its own weights (``fastsync.bench.local.reference_engine_tensors``): ``verified``.

Presets are scaled down for a CPU host (``scaled_config``): same architecture and head size,
fewer layers, narrower MLP, smaller vocabulary.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
import zlib
from dataclasses import dataclass, replace
from typing import Any

from fastsync.bench.rows import collect_rows, exits
from fastsync.errors import ConfigError
from fastsync.procs import rank_context

__all__ = ["DeltaBenchConfig", "scaled_config", "run_delta_bench"]


@dataclass(slots=True)
class DeltaBenchConfig:
    model: str
    steps: int = 5
    lr: float = 1e-6
    rollouts: int = 2
    batch: int = 4
    seq: int = 64
    port: int = 0
    timeout_s: float = 120.0
    seed: int = 0
    threads: int = 1
    control_host: str = "127.0.0.1"
    hosts: int = 0  # 2: the trainer on one network-namespace host, the engine ranks on another
    nic_gbps: float = 0.0


def scaled_config(model: str) -> dict:
    """The HF config of ``model`` (a preset or a directory), scaled for this machine when a preset."""
    from fastsync import plugins

    presets = plugins.model_presets()  # the registered preset configs
    if model in presets:
        cfg = dict(presets[model].obj())
        if cfg.get("model_type") != "qwen3":
            raise ConfigError(f"delta-bench --model {model!r}: only dense Qwen3 presets are scaled here "
                              "(qwen3-0.6b, qwen3-8b); pass a directory with a config.json for others")
        heads = 4
        cfg.update(num_hidden_layers=4, hidden_size=heads * cfg.get("head_dim", 128), num_attention_heads=heads,
                   num_key_value_heads=2, intermediate_size=1408, vocab_size=8000, max_position_embeddings=512)
        return cfg
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ConfigError(f"delta-bench --model {model!r}: neither a preset ({sorted(presets)}) nor a directory "
                          "with a config.json")
    from fastsync.layout.config_json import read_config_json

    return read_config_json(path)


def _layouts(cfg: dict, rollouts: int) -> tuple[Any, Any, Any, Any]:
    from fastsync.layout.engine import build_engine_layout
    from fastsync.layout.namemap import get_name_map
    from fastsync.layout.trainer import fsdp_layout
    from fastsync.models.inventory import inventory_from_config
    from fastsync.plan.planner import build_plan

    inv = inventory_from_config(cfg, name="delta-bench", dtype="float32")
    name_map = get_name_map(inv.architecture, inv.config)
    trainer = fsdp_layout(inv.params, 1)
    engine = build_engine_layout(inv, name_map, tp=rollouts, dtype="bfloat16")
    plan = build_plan(inv.params, trainer, engine, allow_unread=True)
    return inv, trainer, engine, plan


def _crcs(tensors: dict[str, Any]) -> dict[str, int]:
    from fastsync.executor.staging import as_bytes

    return {n: zlib.crc32(as_bytes(t.contiguous()).numpy()) for n, t in sorted(tensors.items())}


def _trainer(cfg: DeltaBenchConfig, results: Any) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    torch.set_num_threads(cfg.threads)
    from fastsync.control import TCPStoreControl
    from fastsync.layout.types import Shard
    from fastsync.sync.delta_sender import DeltaSender
    from fastsync.bench.local import reference_engine_tensors

    try:
        control = TCPStoreControl.client(cfg.port, host=cfg.control_host, timeout_s=cfg.timeout_s)
        hf = scaled_config(cfg.model)
        inv, trainer, engine, plan = _layouts(hf, cfg.rollouts)
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(cfg.seed)
        conf = AutoConfig.for_model(**{k: v for k, v in hf.items() if k not in ("architectures",)})
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
        params = dict(model.named_parameters(remove_duplicate=False))  # tied lm_head included
        missing = sorted(set(inv.params) - set(params))
        if missing:
            raise ConfigError(f"the HF model lacks inventory parameters {missing[:4]}")
        sources = {n: params[n].data for n in inv.params}
        shards = {n: [Shard(0, trainer.shards[n][0].box, 0)] for n in inv.params}
        sender = DeltaSender(rank=0, plan=plan, sources=sources, shards=shards, control=control,
                             timeout_s=cfg.timeout_s, staging_bytes=64 << 20)
        sender.setup()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        nprocs = 1 + cfg.rollouts

        def sync(version: int, kind: str) -> dict:
            expect = {r: _crcs(t) for r, t in reference_engine_tensors(
                {n: p.detach() for n, p in sources.items()}, engine).items()}
            control.set(f"dbench/expect/{version}", json.dumps(expect))
            control.barrier(f"dbench/{version}", nprocs, cfg.timeout_s)
            t0 = time.time()
            sender.sync(version, verify=False, wait_receivers=True)
            return {"version": version, "kind": kind, "start": t0, **sender.last_stats,
                    "stages": dict(sender.last_metrics.stages)}

        results.put({"kind": "trainer", "row": sync(1, "dense"), "step": 0, "params": sum(p.numel() for p in model.parameters())})
        for step in range(1, cfg.steps + 1):
            ids = torch.randint(0, hf["vocab_size"], (cfg.batch, cfg.seq), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rows = [sync(2 * step, "delta"), sync(2 * step + 1, "dense")]
            results.put({"kind": "trainer", "step": step, "loss": loss.item(), "rows": rows})
        sender.close()
        results.put({"kind": "exit", "role": "trainer"})
    except BaseException as e:
        results.put({"kind": "crash", "role": "trainer", "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()})
        raise


def _engine(cfg: DeltaBenchConfig, rank: int, results: Any) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    torch.set_num_threads(cfg.threads)
    from fastsync.control import TCPStoreControl
    from fastsync.sync.delta_receiver import DeltaReceiver

    try:
        control = TCPStoreControl.client(cfg.port, host=cfg.control_host, timeout_s=cfg.timeout_s)
        _, _, engine, plan = _layouts(scaled_config(cfg.model), cfg.rollouts)
        tensors = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for n, t in engine.tensors[rank].items()}
        rx = DeltaReceiver(rank=rank, plan=plan, tensors=tensors, control=control, timeout_s=cfg.timeout_s,
                           mode="inplace", backup=True)
        rx.setup()
        versions = [(1, True)] + [(v, kind) for s in range(1, cfg.steps + 1) for v, kind in ((2 * s, False), (2 * s + 1, True))]
        for version, dense in versions:
            control.barrier(f"dbench/{version}", 1 + cfg.rollouts, cfg.timeout_s)
            rx.sync(version, dense=dense)
            t1 = time.time()
            expect = json.loads(control.get(f"dbench/expect/{version}", cfg.timeout_s, what="the trainer's CRCs"))
            got = _crcs(tensors)
            results.put({"kind": "engine", "rank": rank, "version": version, "end": t1,
                         "verified": got == expect[str(rank)], "bytes_inbox": rx.inbox_bytes,
                         "stages": dict(rx.last_metrics.stages)})
            rx.prepare()  # refresh the in-place backup between syncs, off the timed path
        rx.close()
        results.put({"kind": "exit", "role": "engine", "rank": rank})
    except BaseException as e:
        results.put({"kind": "crash", "role": f"engine {rank}", "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()})
        raise


def run_delta_bench(cfg: DeltaBenchConfig, timeout_s: float = 1800.0) -> dict:
    """Spawn the trainer and engine processes, collect and summarise (see the module docstring)."""
    from fastsync.control import TCPStoreControl

    if cfg.steps < 1 or cfg.rollouts < 1 or cfg.lr <= 0:
        raise ConfigError(f"delta-bench: need --steps >= 1, --rollouts >= 1 and --lr > 0 (got {cfg.steps}, "
                          f"{cfg.rollouts}, {cfg.lr})")
    hf = scaled_config(cfg.model)
    _, _, _, plan = _layouts(hf, cfg.rollouts)  # refuse a bad model before spawning anything
    load_before = os.getloadavg()[0]
    rig = None
    if cfg.hosts:
        from fastsync.bench.netns_cluster import HostRig

        if cfg.hosts != 2:
            raise ConfigError(f"delta-bench --hosts {cfg.hosts}: only 2 is supported (the trainer on one host, the "
                              "engine ranks on the other)")
        rig = HostRig(2, cfg.nic_gbps)
    try:
        return _run(cfg, hf, plan, rig, load_before, timeout_s)
    finally:
        if rig is not None:
            rig.close()


def _run(cfg: DeltaBenchConfig, hf: dict, plan: Any, rig: Any, load_before: float, timeout_s: float) -> dict:
    from fastsync.control import TCPStoreControl

    if rig is not None:
        with rig.entered(0):
            store = TCPStoreControl.server(port=0, host=rig.addr(0), timeout_s=cfg.timeout_s)
        cfg = replace(cfg, port=store.port, control_host=rig.addr(0))
    else:
        store = TCPStoreControl.server(port=0, timeout_s=cfg.timeout_s)
        cfg = replace(cfg, port=store.port)
    ctx = rank_context()
    results = ctx.Queue()

    def proc(target: Any, host: int, *args: Any) -> Any:
        if rig is None:
            return ctx.Process(target=target, args=args, daemon=True)
        from fastsync.bench.netns import run_in_host

        return ctx.Process(target=run_in_host, args=(rig.hosts[host].ns, rig.env(host, {}), target, *args),
                           daemon=True)

    procs = [proc(_trainer, 0, cfg, results)]
    procs += [proc(_engine, 1, cfg, r, results) for r in range(cfg.rollouts)]
    rows: list[dict] = []
    nic0 = rig.nic_bytes(0)[0] if rig is not None else 0
    try:
        for p in procs:
            p.start()
        collect_rows(results, {f"worker {i}": p for i, p in enumerate(procs)}, done=lambda got: exits(got) >= len(procs),
                     timeout_s=timeout_s, what="delta-bench", rows=rows)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    rep = _summarise(cfg, hf, plan, rows)
    if rig is not None:  # what crossed the trainer host's NIC, all syncs together
        rep["hosts"], rep["nic_gbps"] = cfg.hosts, cfg.nic_gbps
        rep["trainer_nic_tx_bytes"] = rig.nic_bytes(0)[0] - nic0
        rep["planned_bytes_all_syncs"] = sum(s["bytes_dense"] + s["bytes_delta"] for s in rep["steps"]) + plan.bytes_total
    rep["threads"] = cfg.threads
    rep["load_avg_1min"] = [load_before, os.getloadavg()[0]]  # a shared machine: read figures beside it
    return rep


def _summarise(cfg: DeltaBenchConfig, hf: dict, plan: Any, rows: list[dict]) -> dict:
    ends: dict[int, list[float]] = {}
    ok: dict[int, list[bool]] = {}
    estages: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("kind") == "engine":
            for k, v in r["stages"].items():
                estages.setdefault(r["version"], {})[k] = max(v, estages.get(r["version"], {}).get(k, 0.0))
            ends.setdefault(r["version"], []).append(r["end"])
            ok.setdefault(r["version"], []).append(r["verified"])
    def verified(version: int) -> bool:  # every engine rank checked this version, and all matched
        return len(ok.get(version, [])) == cfg.rollouts and all(ok[version])

    steps = []
    first = next(r for r in rows if r.get("kind") == "trainer" and r["step"] == 0)
    for r in sorted((r for r in rows if r.get("kind") == "trainer" and r["step"] > 0), key=lambda r: r["step"]):
        delta, dense = r["rows"]

        def secs(row: dict) -> float:
            return max(ends[row["version"]]) - row["start"]

        steps.append({
            "step": r["step"], "loss": r["loss"],
            "changed_fraction": delta["changed"] / max(delta["elements"], 1),
            "bytes_dense": plan.bytes_total, "bytes_delta": delta["bytes_sent"],
            "seconds_dense": secs(dense), "seconds_delta": secs(delta),
            "stages_delta": {"trainer": delta["stages"], "engine_max": estages.get(delta["version"], {})},
            "stages_dense": {"trainer": dense["stages"], "engine_max": estages.get(dense["version"], {})},
            "verified": verified(delta["version"]) and verified(dense["version"]),
        })
    bytes_ratio = sum(s["bytes_delta"] for s in steps) / max(sum(s["bytes_dense"] for s in steps), 1)
    seconds_ratio = (statistics.median(s["seconds_delta"] for s in steps)
                     / max(statistics.median(s["seconds_dense"] for s in steps), 1e-9))
    return {
        "model": cfg.model, "lr": cfg.lr, "rollouts": cfg.rollouts, "params": first["params"],
        "config": {k: hf.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
                                          "num_attention_heads", "num_key_value_heads", "head_dim")},
        "initial_sync_verified": verified(1),
        "steps": steps,
        "summary": {"bytes_ratio": bytes_ratio, "seconds_ratio": seconds_ratio,
                    "changed_fraction": statistics.mean(s["changed_fraction"] for s in steps),
                    "verified": len(steps) == cfg.steps and all(s["verified"] for s in steps) and verified(1)},
    }
