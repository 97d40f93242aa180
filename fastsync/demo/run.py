"""The end-to-end demo: trainer processes holding FSDP2 shards write into a live vLLM engine.

One process hosts the vLLM engine (with the fastsync worker extension) and serves requests over
the control plane (``fastsync.engines.vllm.remote.serve``); ``num_trainers`` spawned processes
form a gloo world, shard an HF transformers-v5 model with FSDP2 ``fully_shard``, take a real
training step (Adam on random tokens), and sync:

* ``fastsync``: every trainer rank writes its own shards straight into the engine's memory
  (static plan, NIXL one-sided WRITEs);
* ``rank0`` baseline (verl's ``NCCLCheckpointEngine.send_weights``, ``fastsync.demo.baseline``):
  every rank gathers full tensors (``DTensor.full_tensor()``), trainer rank 0 copies them into its
  bucket and alone sends it to the engine.

Trainer rank 0 compares the engine's greedy tokens with the trainer model's own greedy tokens
(HF forward on the gathered weights, cast to the engine's dtype) before and after each sync.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from fastsync.procs import rank_context

__all__ = ["run_demo", "hf_greedy", "DEFAULT_PROMPTS", "prompts_for", "engine_kwargs"]

DEFAULT_PROMPTS: list[list[int]] = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123], [400, 3, 77]]


def prompts_for(model_dir: str) -> list[list[int]]:
    """:data:`DEFAULT_PROMPTS` folded into the vocabulary of ``model_dir``'s ``config.json`` (a
    user's model may have a small one)."""
    with open(os.path.join(str(model_dir), "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or 1 << 30
    return [[t % vocab for t in p] for p in DEFAULT_PROMPTS]


def engine_kwargs(model_dir: str, tp: int = 1, dtype: str = "bfloat16") -> dict:
    """``vllm.LLM`` arguments that work on a CPU host (see shared notes): no tokenizer, eager,
    small KV cache, the fastsync worker extension; for an MLA model on a CPU with AMX, the
    CPU_MLA attention backend (``fastsync.engines.vllm.mla``: fastsync cannot write AMX_MLA's
    packed copies)."""
    from fastsync.engines.vllm import EXTENSION
    from fastsync.engines.vllm.mla import attention_config

    kw = dict(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
              max_model_len=256, kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp,
              worker_extension_cls=EXTENSION, seed=0)
    cfg_path = os.path.join(str(model_dir), "config.json")
    if os.path.exists(cfg_path):
        from fastsync.engines.vllm.cpu_limits import check_cpu_engine

        with open(cfg_path) as f:
            cfg = json.load(f)
        check_cpu_engine(cfg, f"checkpoint {model_dir}")  # before a minute of engine start, naming the sizes
        attn = attention_config(cfg, dtype)
        if attn is not None:
            kw["attention_config"] = attn
    return kw


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by an HF causal LM (full forward per token, no cache)."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(max_tokens):
                logits = model(input_ids=ids).logits[0, -1]
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def _full_state(model: Any) -> dict:
    """Full tensors of every parameter on every rank (a collective under FSDP2)."""
    from torch.distributed.tensor import DTensor

    return {n: (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()
            for n, t in model.state_dict(keep_vars=True).items()}


def _hf_model(model_dir: str, full: dict, dtype: str) -> Any:
    """The trainer's transformers model rebuilt from ``model_dir``'s config, holding ``full`` in ``dtype``."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    dt = getattr(torch, dtype)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=dt)
    ref.load_state_dict({n: t.to(dt) for n, t in full.items()}, strict=False)
    return ref


def _reference(model_dir: str, full: dict, prompts: list[list[int]], max_tokens: int,
               dtype: str = "bfloat16") -> list[list[int]]:
    """The trainer model's own greedy tokens, with its weights in the engine's ``dtype``."""
    ref = _hf_model(model_dir, full, dtype)
    ref.eval()
    return hf_greedy(ref, prompts, max_tokens)


def _save_reference(model_dir: str, full: dict, out_dir: str, dtype: str) -> None:
    """The trainer's weights saved as an HF checkpoint (transformers writes the checkpoint's own
    names, e.g. per-expert weights), for a fresh vLLM engine to load with vLLM's own loaders."""
    _hf_model(model_dir, full, dtype).save_pretrained(out_dir)


def _train_step(model: Any, opt: Any, vocab: int, seed: int) -> float:
    import torch

    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(3, vocab, (2, 16), generator=g)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def trainer_main(rank: int, world: int, port: int, model_dir: str, opts: dict, out: Any) -> None:
    """One trainer process (spawned)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fastsync.control import TCPStoreControl
    from fastsync.engines.vllm.remote import RemoteEngine
    from fastsync.demo.baseline import rank0_baseline
    from fastsync.sync import WeightSync

    torch.set_num_threads(1)
    report: dict = {"rank": rank}
    control = TCPStoreControl.client(port)
    engine = RemoteEngine(control) if rank == 0 else None
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("trainers/", control.store), rank=rank, world_size=world)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if opts.get("fsdp", True) and world > 1:
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=opts.get("lr", 0.02))
        prompts, max_tokens = opts["prompts"], opts["max_tokens"]
        timeout = opts.get("timeout_s", 120.0)
        repeats = opts.get("repeats", 3)

        ws = WeightSync(model, rank=rank, world_size=world, control=control, engines=[engine] if engine else [],
                        transport=opts.get("transport", "nixl"), timeout_s=timeout, staged=bool(opts.get("staged")),
                        pause_mode=opts.get("pause_mode", "wait"), verify=opts.get("verify", "off"))
        ws.setup()
        report["setup_s"] = ws.setup_s
        def generate() -> list[list[int]]:
            if opts.get("reference_dir"):  # one request at a time, as the fresh engine is asked (some kernels,
                return [engine.generate([p], max_tokens)[0] for p in prompts]  # e.g. CPU MLA, vary with the batch)
            return engine.generate(prompts, max_tokens)

        if rank == 0:
            report["staged"] = ws.engine_info[0][0].get("staged", {})
            report["before_engine"] = generate()
            report["version_before"] = engine.version()
        vocab = model.config.vocab_size
        report["loss"] = _train_step(model, opt, vocab, seed=1)
        full = _full_state(model)
        if rank == 0 and opts.get("reference_dir"):  # the parent loads these weights into a fresh vLLM engine
            _save_reference(model_dir, full, opts["reference_dir"], opts["dtype"])
        elif rank == 0:
            report["after_trainer"] = _reference(model_dir, full, prompts, max_tokens, opts["dtype"])
        times = []
        version = 0
        for _ in range(repeats):
            dist.barrier()
            version += 1
            res = ws.sync(version, timeout_s=timeout)
            times.append(res.seconds)
        if opts.get("load"):  # the same syncs while a client keeps requests going to the engine
            loaded, stalls = [], []
            if rank == 0:
                control.set("demo/load", b"1")
            for _ in range(repeats):
                dist.barrier()
                version += 1
                res = ws.sync(version, timeout_s=timeout)
                loaded.append(res.seconds)
                if rank == 0:  # how long the engine held generation back for this sync
                    stalls.append(max(float(w.get("stall_s", 0.0)) for w in res.engines[0]))
            if rank == 0:
                control.set("demo/load", b"0")
            report["loaded_s"], report["engine_stall_s"] = loaded, stalls
            report["loaded_versions"] = list(range(version - repeats + 1, version + 1))
        ws.close()
        report["fastsync_s"] = times
        if rank == 0:
            report["engine_side"] = res.engines[0]  # per worker: wait_s, finish_s, postprocess_s (repack)
            report["fallback"] = res.fallback  # through vLLM's load_weights instead of in place
        if rank == 0:
            report["after_engine"] = generate()
            report["version_after"] = engine.version()

        if opts.get("baseline", True):
            report["loss2"] = _train_step(model, opt, vocab, seed=2)
            btimes, gtimes, held, version = rank0_baseline(model, rank, control, engine, port, opts, version, timeout,
                                                           repeats)
            report["baseline_s"], report["baseline_gather_s"] = btimes, gtimes
            if rank == 0:
                report["after2_engine"] = engine.generate(prompts, max_tokens)
                report["after2_trainer"] = _reference(model_dir, held, prompts, max_tokens, opts["dtype"])
                report["version_after2"] = engine.version()
        dist.barrier()
        report["ok"] = True
    except BaseException as e:  # reported to the host, which prints it
        report["ok"] = False
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        if engine is not None:
            try:
                engine.stop()
            except Exception:
                pass
        out.put(report)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_demo(*, model_dir: str | None = None, preset: str = "small-qwen3-moe", num_trainers: int = 2,
             workdir: str | None = None, prompts: list[list[int]] | None = None, max_tokens: int = 8,
             transport: str = "nixl", baseline: bool = True, repeats: int = 3, tp: int = 1,
             fsdp: bool = True, timeout_s: float = 120.0, dtype: str = "float32", log: Any = print,
             progress: bool = False, staged: bool = False, load: bool = False, pause_mode: str = "wait",
             verify: str = "off",
             reference: str = "hf") -> dict:
    """Run the whole demo; returns trainer rank 0's report plus engine start time. ``progress``:
    name the step under way on stderr (checkpoint, engine start, trainers). ``staged``: fastsync's
    syncs receive while the engine generates, pausing only for the flip. ``load``: a client keeps
    requests going to the engine throughout, so the report can say what each sync did to them.
    ``pause_mode``: what the engine does with the requests in flight at each pause (vLLM's
    ``wait`` / ``abort`` / ``keep``, ``WeightSync(pause_mode=...)``). ``verify``: what the engine
    checks of each fastsync sync before its flip (``WeightSync(verify=...)``, inside the timed
    sync). ``reference``: what the
    engine's tokens after the sync are checked against: ``"hf"``, the trainer's transformers
    model on the new weights; ``"vllm"``, a fresh vLLM engine that loads the new weights from a
    checkpoint with vLLM's own loaders (for models whose transformers and vLLM implementations
    do not agree token for token, e.g. a tiny DeepSeek-V3 on vLLM-CPU's MLA)."""
    from fastsync.control import TCPStoreControl
    from fastsync.demo.checkpoints import build_tiny_checkpoint
    from fastsync.errors import ConfigError, SyncError

    from fastsync.layout.limits import check_count, check_seconds

    check_count("num_trainers (--trainers)", num_trainers, hi=8)
    check_count("tp (--tp)", tp, hi=8)
    check_count("repeats (--repeats)", repeats, hi=1000)
    check_count("max_tokens (--max-tokens)", max_tokens, hi=200)
    check_seconds("timeout_s (--timeout)", timeout_s)
    if reference not in ("hf", "vllm"):
        raise ConfigError(f"reference (--reference) must be 'hf' or 'vllm', not {reference!r}")
    from fastsync import plugins

    if transport not in plugins.transports():
        raise ConfigError(f"transport (--transport) {transport!r} is not registered; registered: {sorted(plugins.transports())}")
    from fastsync.trace.progress import Steps

    steps = Steps(3, enabled=progress, desc="fastsync demo")
    steps.next("building the checkpoint")
    if model_dir is None:
        base = Path(workdir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "fastsync-demo"))
        model_dir = str(build_tiny_checkpoint(preset, base / preset))
        log(f"checkpoint: {preset} (random weights) in {model_dir}")
    if prompts is None:
        prompts = prompts_for(model_dir)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    control = TCPStoreControl.server(port=0)
    ctx = rank_context()
    q = ctx.Queue()
    opts = {"prompts": prompts, "max_tokens": max_tokens, "transport": transport, "baseline": baseline,
            "repeats": repeats, "fsdp": fsdp, "timeout_s": timeout_s, "dtype": dtype, "staged": staged, "load": load,
            "pause_mode": pause_mode, "verify": verify}
    if reference == "vllm":
        import tempfile

        opts["reference_dir"] = tempfile.mkdtemp(prefix="fastsync-reference-")
    procs = [ctx.Process(target=trainer_main, args=(r, num_trainers, control.port, model_dir, opts, q), daemon=True)
             for r in range(num_trainers)]
    for p in procs:
        p.start()
    report: dict = {}
    try:
        from vllm import LLM

        from fastsync.engines.vllm.handle import VllmEngine
        from fastsync.engines.vllm.remote import serve

        t0 = time.perf_counter()
        steps.next(f"starting the vLLM engine (tp={tp})")
        llm = LLM(**engine_kwargs(model_dir, tp, dtype))
        engine_start_s = time.perf_counter() - t0
        log(f"vLLM engine (tp={tp}) started in {engine_start_s:.1f} s; {num_trainers} trainer processes")
        steps.next(f"{num_trainers} trainers: set-up, a training step, {repeats} syncs per path")
        eng = VllmEngine(llm)
        calls: list[tuple[float, float]] = []
        stop = threading.Event()
        client = threading.Thread(target=_keep_generating, args=(eng, control, prompts, max_tokens, calls, stop),
                                  daemon=True)
        if load:
            client.start()
        try:
            serve(eng, control, idle_timeout_s=timeout_s * 4)
        finally:
            stop.set()
            if load:
                client.join(timeout=60)
        steps.close()
        reports = [q.get(timeout=timeout_s) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        bad = [r for r in reports if not r.get("ok")]
        if bad:
            raise SyncError("; ".join(f"trainer rank {r['rank']}: {r.get('error')}" for r in bad))
        report = next(r for r in reports if r["rank"] == 0)
        report["reference"] = reference
        report["engine_start_s"] = engine_start_s
        report["staged_mode"] = staged
        report["model_dir"] = model_dir
        report["num_trainers"] = num_trainers
        report["pause_mode"] = pause_mode
        report["verify"] = verify
        report["updates"] = [{**h, "requests_finished_during": sum(h["start"] <= e <= h["end"] for _, e in calls),
                              "requests": eng.outcomes(h)} for h in eng.history]
        report["requests_total"] = len(calls)
        report["sync_s_max_over_ranks"] = {
            "fastsync": [max(r["fastsync_s"][i] for r in reports) for i in range(repeats)],
            "baseline": [max(r["baseline_s"][i] for r in reports) for i in range(repeats)] if baseline else [],
        }
        if reference == "vllm":  # the synced engine goes; a fresh one loads the trainer's weights from disk
            del eng, llm
            fresh = VllmEngine(LLM(**engine_kwargs(opts["reference_dir"], tp, dtype)))
            report["after_trainer"] = [fresh.generate([p], max_tokens)[0] for p in prompts]
            del fresh
        return report
    finally:
        steps.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if opts.get("reference_dir"):
            import shutil

            shutil.rmtree(opts["reference_dir"], ignore_errors=True)


def _keep_generating(eng: Any, control: Any, prompts: list[list[int]], max_tokens: int, calls: list,
                     stop: Any) -> None:
    """A client that keeps one request after another going to the engine while trainer rank 0
    says so (``demo/load``): the demo's load during its third series of syncs."""
    while not stop.is_set():
        if control.try_get("demo/load") != b"1":
            time.sleep(0.005)
            continue
        t0 = time.time()
        try:
            eng.generate(prompts[:1], max_tokens)
        except Exception:  # the engine is shutting down
            return
        calls.append((t0, time.time()))


def summarize(report: dict) -> dict:
    """The demo's verdicts and headline numbers."""
    fs = statistics.median(report["sync_s_max_over_ranks"]["fastsync"])
    pairs = [(a, b) for ea, eb in zip(report["after_engine"], report["after_trainer"]) for a, b in zip(ea, eb)]
    out = {
        "verify": report.get("verify", "off"),
        "fallback": report.get("fallback"),
        "changed": report["after_engine"] != report["before_engine"],
        "match": report["after_engine"] == report["after_trainer"],
        "tokens_equal": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
        "fastsync_sync_s": fs,
        "version": [report["version_before"], report["version_after"]],
    }
    if report.get("engine_stall_s"):
        loaded = statistics.median(report["loaded_s"])
        out["loaded_sync_s"] = loaded
        out["engine_stall_seconds"] = statistics.median(report["engine_stall_s"])
        out["stall_share_of_sync"] = out["engine_stall_seconds"] / loaded if loaded > 0 else None
        vs = set(report["loaded_versions"])
        out["requests_finished_during_syncs"] = sum(u["requests_finished_during"] for u in report.get("updates", [])
                                                    if u["version"] in vs)
        loaded_updates = [u for u in report.get("updates", []) if u["version"] in vs]
        out["requests_aborted"] = sum(u["requests"]["aborted"] for u in loaded_updates)
        out["pause_mode"] = report.get("pause_mode", "wait")
        # per sync under load: the trainers' sync time, the engine's stall (no forward pass: the
        # flip), the drain (wait: requests in flight finishing first) and the requests in flight
        # by outcome
        per_v = dict(zip(report["loaded_versions"], report["loaded_s"]))
        out["syncs"] = [{"version": u["version"], "sync_s": per_v.get(u["version"]),
                         "engine_stall_seconds": u.get("stall_s"), "drain_s": u.get("drain_s", 0.0),
                         "requests_in_flight": len(u.get("in_flight", [])), **u["requests"]}
                        for u in loaded_updates]
    if report["sync_s_max_over_ranks"]["baseline"]:
        bs = statistics.median(report["sync_s_max_over_ranks"]["baseline"])
        out.update({"baseline_sync_s": bs, "speedup": bs / fs if fs > 0 else float("inf"),
                    "baseline_match": report["after2_engine"] == report["after2_trainer"],
                    "baseline_changed": report["after2_engine"] != report["after_engine"]})
    return out
