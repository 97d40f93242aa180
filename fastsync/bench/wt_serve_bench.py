"""``fastsync weight-transfer-bench --serve``: what an update through vLLM's weight-transfer API
costs the generation of a real ``vllm serve``, per pause mode, staged or not.

Order: one ``vllm serve`` (``fastsync.bench.wt_serve.VllmServe``, CPU, the preset or local
checkpoint, ``--weight-transfer-config '{"backend": "fastsync"}'``); one trainer rank in this
process over the HF model of the same checkpoint (vLLM's ``ModuleSource``). For each
configuration (``staged`` x ``pause_mode``): ``trainer_init``, one untimed warm-up update, then
``syncs`` rounds of: change every weight; start ``in_flight`` long greedy requests (streamed
through ``/inference/v1/generate``) and wait until each has its first token; ``send_weights``
(timed: ``sync_s``, the whole round trip as the trainer sees it); let the requests finish and sort
them by outcome (finished on the old weights, carried across the flip, aborted: from vLLM's
``weight_versions`` spans and ``finish_reason``); check that the server's greedy tokens equal the
trainer model's and that ``/weight_info`` is the round's label.

Per round, from trainer rank 0's record of the update: ``transfer_s`` (start to every write
landed; not staged: from the pause), ``drain_s`` (vLLM's pause call: under ``wait`` the requests
in flight finishing, new ones queued), ``stall_s`` (``engine_stall_seconds``: from the pause's
return to the resume's, no forward pass ran), and ``worker_update_s``, the longest time a worker
spent inside ``update_weights`` (staged: the flip, i.e. the shadow copy and the CPU repacks; not
staged: the whole receive): the rest of the stall is vLLM's calls (``/update_weights``,
``/finish_weight_update``, ``/resume``, each an HTTP request, an engine-core utility call and a
collective RPC). Medians over the rounds, and the stall over the sync.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

from fastsync.errors import ConfigError
from fastsync.sync.pause_modes import PAUSE_MODES

__all__ = ["run_serve_bench"]

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123]]
CHECK_TOKENS = 6


def _requests(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], list[dict]]:
    """``n`` long requests on their own threads; returns once each has its first token."""
    from fastsync.bench.wt_serve import generate

    boxes: list[dict] = [{} for _ in range(n)]
    firsts = [threading.Event() for _ in range(n)]

    def run(i: int) -> None:
        prompt = [7 + i, 11, 13 + 2 * i]
        try:
            boxes[i].update(generate(url, prompt, max_tokens, on_token=firsts[i].set))
        except Exception as e:  # reported as the round's error
            boxes[i]["error"] = f"{type(e).__name__}: {e}"
        finally:
            firsts[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 300
    for ev in firsts:
        ev.wait(max(0.0, deadline - time.monotonic()))
    return threads, boxes


def _config_rows(srv: Any, hf: Any, staged: bool, mode: str, syncs: int, in_flight: int, max_tokens: int,
                 seed0: int, secret: str) -> dict:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from fastsync.bench.wt_serve import OUTCOMES, generate, outcome
    from fastsync.bench.weight_transfer import trainer_greedy, perturb
    from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo

    t0 = time.perf_counter()
    eng = WeightTransferTrainerFactory.trainer_init(
        FastSyncTrainerInitInfo(rank=0, staged=staged, pause_mode=mode, secret=secret),
        client=HTTPVLLMWeightSyncClient(srv.url), source=ModuleSource(hf))
    row: dict[str, Any] = {"staged": staged, "pause_mode": mode, "trainer_init_s": time.perf_counter() - t0}
    rounds: list[dict] = []
    checks: list[bool] = []
    try:
        for i in range(syncs + 1):  # round 0: warm-up, no requests, not counted
            perturb(hf, seed0 + i)
            label = f"{'staged' if staged else 'dense'}-{mode}-{i}"
            threads, boxes = _requests(srv.url, in_flight, max_tokens) if i else ([], [])
            t0 = time.perf_counter()
            res = eng.send_weights(weight_version=label)
            sync_s = time.perf_counter() - t0
            # inside the workers, update_weights' own time: the flip (staged) or the whole receive
            worker_s = max(float(e.get("update_s", 0.0)) for e in res.engines[0])
            for th in threads:
                th.join(600)
            rec = eng.updates[-1]
            served = [generate(srv.url, p, CHECK_TOKENS)["token_ids"] for p in PROMPTS]
            checks.append(served == trainer_greedy(hf) and srv.get("/weight_info") == {"weight_version": label})
            if not i:
                continue
            counts = dict.fromkeys(OUTCOMES, 0)
            for b in boxes:
                if "error" in b:
                    raise ConfigError(f"a request in flight failed: {b['error']}")
                counts[outcome(b, label)] += 1
            rounds.append({"sync_s": sync_s, "transfer_s": rec.get("transfer_s"), "drain_s": rec.get("drain_s", 0.0),
                           "stall_s": rec.get("stall_s"), "worker_update_s": worker_s,
                           "paused_by": rec.get("paused_by"), **counts})
    finally:
        eng.shutdown()

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rounds)

    row.update(rounds=rounds, sync_median_s=med("sync_s"), transfer_median_s=med("transfer_s"),
               drain_median_s=med("drain_s"), stall_median_s=med("stall_s"), worker_update_median_s=med("worker_update_s"),
               outcomes={k: sum(r[k] for r in rounds) for k in OUTCOMES},
               verified=all(checks), rounds_verified=f"{sum(checks)}/{len(checks)}")
    row["stall_ratio"] = row["stall_median_s"] / row["sync_median_s"]
    return row


def run_serve_bench(model: str = "tiny", *, pause_modes: tuple[str, ...] = PAUSE_MODES, staged: tuple[bool, ...] =
                    (True, False), syncs: int = 3, in_flight: int = 2, max_tokens: int = 200, tp: int = 1,
                    workdir: str | None = None) -> dict:
    """Run the bench (see the module doc); returns the report the CLI prints."""
    from fastsync.bench.weight_transfer import PRESETS, check_entry_point, preset_checkpoint

    for name, v, lo in (("--syncs", syncs, 1), ("--in-flight", in_flight, 1), ("--max-tokens", max_tokens, 1),
                        ("--tp", tp, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be an int >= {lo}, got {v!r}")
    bad = [m for m in pause_modes if m not in PAUSE_MODES]
    if bad or not pause_modes:
        raise ConfigError(f"--pause-modes: {bad or 'none given'}; vLLM's pause modes are {list(PAUSE_MODES)}")
    if max_tokens > 400:
        raise ConfigError(f"--max-tokens {max_tokens}: the presets' max_model_len is 512 (prompt included); use <= 400")
    if not os.path.isdir(model) and model not in PRESETS:
        raise ConfigError(f"--model {model!r}: not a directory and not a preset ({sorted(PRESETS)})")
    check_entry_point()
    import torch
    import transformers

    from fastsync.bench.wt_serve import VllmServe
    from fastsync.security import job_secret

    secret = job_secret(create=True).hex()  # the server's workers get it through their environment
    work = workdir or os.path.join(os.path.expanduser("~"), ".cache", "fastsync", "wt-bench")
    ckpt = preset_checkpoint(model, work)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    log_path = os.path.join(work, f"serve-{os.getpid()}.log")
    t0 = time.perf_counter()
    rows = []
    with VllmServe(ckpt, log_path=log_path, tp=tp, env={"FASTSYNC_JOB_SECRET": secret}) as srv:
        start_s = time.perf_counter() - t0
        for s in staged:
            for j, mode in enumerate(pause_modes):
                rows.append(_config_rows(srv, hf, s, mode, syncs, in_flight, max_tokens,
                                         seed0=1000 * (len(rows) + 1) + j, secret=secret))
    return {"model": model, "checkpoint": ckpt, "params": sum(p.numel() for p in hf.parameters()),
            "bytes": sum(p.numel() * p.element_size() for p in hf.parameters()), "dtype": "float32",
            "engine": f"vllm serve, vLLM-CPU tp={tp}", "engine_start_s": start_s, "syncs": syncs,
            "in_flight": in_flight, "max_tokens": max_tokens, "configs": rows,
            "verified": all(r["verified"] for r in rows)}
