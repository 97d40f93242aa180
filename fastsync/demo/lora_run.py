"""The LoRA demo (``python examples/vllm_sync.py --model DIR --lora-rank R``): a PEFT trainer's
adapter versions synced in memory into a live vLLM engine's LoRA slots, each one checked.

One process: the vLLM engine (``enable_lora=True``, the fastsync worker extension, TP workers of
its own) and the trainer, a plain PEFT model (no FSDP) on the same checkpoint, LoRA on
q/k/v/o and gate/up/down. In order:

1. ``base`` (on by default): the trainer's base weights go once into the engine with the dense
   :class:`fastsync.sync.WeightSync` (NIXL, checked with ``verify``), as at a job's connect; the
   engine's tokens without an adapter must equal the trainer's.
2. :class:`fastsync.sync.lora_sync.LoraSync` set up once (slot layout recorded from vLLM's own
   ``set_lora``), then ``repeats`` versions: new random adapter matrices, ``LoraSync.sync(v)``,
   then the engine's greedy tokens with version ``v``'s ``LoRARequest`` against the PEFT model's
   (``match``) and the slot's bytes against the slot vLLM's own ``add_lora`` fills from the same
   version saved with ``save_pretrained`` (``bytes_equal``, every linear LoRA stack,
   ``torch.equal``), with both paths' times.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

from fastsync.demo.run import DEFAULT_PROMPTS, engine_kwargs, hf_greedy

__all__ = ["run_lora_demo", "LORA_TARGETS", "engine_max_lora_rank"]

#: the modules the demo's PEFT model puts LoRA on (issue 38: q/k/v/o and gate/up/down)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: vLLM's ``LoRAConfig.max_lora_rank`` takes one of these (``vllm.config.lora.MaxLoRARanks``)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: lora ids of the reference loads (vLLM's own add_lora), clear of fastsync's 1_000_000 + version
REFERENCE_ID_BASE = 900_000


def engine_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    from fastsync.errors import ConfigError

    for m in VLLM_MAX_LORA_RANKS:
        if rank <= m:
            if rank < 1:
                break
            return m
    raise ConfigError(f"--lora-rank {rank}: vLLM takes adapter ranks 1..{VLLM_MAX_LORA_RANKS[-1]}")


def _new_version(pm: Any, seed: int, scale: float = 0.2) -> None:
    """Every LoRA matrix of ``pm`` replaced by new random values (a new adapter version)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * scale)


def run_lora_demo(*, model_dir: str, rank: int, tp: int = 2, dtype: str = "float32", repeats: int = 3,
                  alpha: float = 16.0, transport: str = "nixl", base: bool = True, verify: str = "full",
                  max_tokens: int = 6, prompts: list[list[int]] | None = None, timeout_s: float = 60.0,
                  log: Any = print) -> dict:
    """Run the LoRA demo on ``model_dir``; returns the report (``ok`` False with ``error`` when
    a step raised: what was measured until then stays in the report)."""
    import torch

    from fastsync.control import TCPStoreControl
    from fastsync.errors import ConfigError
    from fastsync.layout.limits import check_count

    check_count("tp (--tp)", tp, hi=8)
    check_count("repeats (--repeats)", repeats, hi=1000)
    max_rank = engine_max_lora_rank(rank)
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype (--dtype) must be float32 or bfloat16, not {dtype!r}")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if prompts is None:  # fold the default prompts into a small vocabulary
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or 1 << 30
        prompts = [[t % vocab for t in p] for p in DEFAULT_PROMPTS]
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rep: dict = {"ok": False, "model": model_dir, "tp": tp, "dtype": dtype, "lora_rank": rank, "lora_alpha": alpha,
                 "engine_max_lora_rank": max_rank, "targets": LORA_TARGETS, "trainers": 1, "repeats": repeats,
                 "versions": []}
    import transformers
    from peft import LoraConfig, get_peft_model
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from fastsync.engines.vllm.handle import VllmEngine
    from fastsync.engines.vllm.lora_host import VllmLoraEngine
    from fastsync.sync import WeightSync
    from fastsync.sync.lora_sync import LoraSync, lora_matrices

    t0 = time.perf_counter()
    # two slots for fastsync's serving and next version, one for the reference add_lora
    llm = LLM(**engine_kwargs(model_dir, tp, dtype), enable_lora=True, max_loras=3, max_lora_rank=max_rank,
              max_cpu_loras=8)
    rep["engine_start_s"] = time.perf_counter() - t0
    log(f"engine start: {rep['engine_start_s']:.1f} s (tp={tp}, enable_lora, max_lora_rank={max_rank})")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def engine_greedy(request: Any) -> list[list[int]]:
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=request,
                           use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]

    control = TCPStoreControl.server(port=0)
    ls: Any = None
    adapters = tempfile.TemporaryDirectory(prefix="fastsync-lora-ref-")
    try:
        trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        if base:
            ws = WeightSync(trainer, rank=0, world_size=1, control=control, engines=[VllmEngine(llm)],
                            control_port=control.port, transport=transport, timeout_s=timeout_s, verify=verify,
                            name="lora-demo-base")
            try:
                t1 = time.perf_counter()
                ws.setup()
                setup_s = time.perf_counter() - t1
                res = ws.sync(1, timeout_s=timeout_s)
            finally:
                ws.close()
            got, want = engine_greedy(None), hf_greedy(trainer, prompts, max_tokens)
            rep["base"] = {"sent": True, "bytes": int(sum(res.metrics.get("bytes_per_link", {}).values())),
                           "sync_s": res.seconds, "setup_s": setup_s, "verify": verify,
                           "fallback_tensors": res.fallback["tensors"], "tokens_equal": got == want}
            log(f"base: {rep['base']['bytes']} B sent once in {res.seconds * 1e3:.1f} ms, tokens equal: {got == want}")
        else:
            rep["base"] = {"sent": False}
        pm = get_peft_model(trainer, LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS,
                                                 lora_dropout=0.0)).eval()
        rep["adapter_bytes"] = int(sum(t.numel() * t.element_size() for t, _ in lora_matrices(pm).values()))
        leng = VllmLoraEngine(llm)
        ls = LoraSync(pm, control=control, engines=[leng], transport=transport, timeout_s=timeout_s,
                      name="lora-demo")
        t1 = time.perf_counter()
        ls.setup()
        rep["lora_setup_s"] = time.perf_counter() - t1
        rep["bytes_per_version"] = ls.bytes_per_version
        base_tokens = engine_greedy(None)
        for v in range(1, repeats + 1):
            _new_version(pm, seed=1000 * rank + v)
            res = ls.sync(v, timeout_s=timeout_s)
            got, want = engine_greedy(leng.request()), hf_greedy(pm, prompts, max_tokens)
            row = {"version": v, "bytes_sent": res.bytes_sent, "sync_s": res.seconds,
                   "flip_s": max(w["flip_s"] for e in res.engines for w in e),
                   "match": got == want, "changed": got != base_tokens}
            # vLLM's own path on the same version: saved by PEFT, loaded by add_lora into another slot
            t1 = time.perf_counter()
            path = os.path.join(adapters.name, f"v{v}")
            pm.save_pretrained(path)
            t2 = time.perf_counter()
            ref_id = REFERENCE_ID_BASE + v
            if not llm.llm_engine.add_lora(LoRARequest(f"reference-v{v}", ref_id, path)):
                raise RuntimeError(f"vLLM's add_lora of version {v} saved to {path} returned False")
            row["add_lora_s"] = time.perf_counter() - t2
            row["save_and_add_lora_s"] = time.perf_counter() - t1
            cmp = leng.lora_compare(leng.lora_id(v), ref_id)
            row["bytes_equal"] = all(c["equal"] for c in cmp)
            row["slot_tensors_compared"] = sum(c["tensors"] for c in cmp)
            if not row["bytes_equal"]:
                row["differ"] = [d for c in cmp for d in c["differ"]][:5]
            llm.llm_engine.remove_lora(ref_id)
            rep["versions"].append(row)
            log(f"version {v}: {res.bytes_sent} B in {res.seconds * 1e3:.1f} ms (flip {row['flip_s'] * 1e3:.2f} ms); "
                f"match {row['match']}, bytes_equal {row['bytes_equal']}; save_pretrained+add_lora "
                f"{row['save_and_add_lora_s'] * 1e3:.1f} ms")
        rep["ok"] = True
    except Exception as e:  # the report says how far it got
        rep["error"] = f"{type(e).__name__}: {e}"
    finally:
        if ls is not None:
            ls.close()
        control.close()
        adapters.cleanup()
    vs = rep["versions"]
    rep["match"] = bool(rep["ok"] and vs and all(r["match"] and r["changed"] for r in vs)
                        and rep["base"].get("tokens_equal", True))
    rep["bytes_equal"] = bool(rep["ok"] and vs and all(r["bytes_equal"] for r in vs))
    if vs:
        rep["sync_s_median"] = statistics.median(r["sync_s"] for r in vs)
        rep["flip_s_median"] = statistics.median(r["flip_s"] for r in vs)
        rep["save_and_add_lora_s_median"] = statistics.median(r["save_and_add_lora_s"] for r in vs)
        rep["add_lora_s_median"] = statistics.median(r["add_lora_s"] for r in vs)
    return rep
