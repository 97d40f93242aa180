"""``fastsync weight-transfer-bench``: the same tiny model through the same vLLM weight-transfer
API calls with ``backend="fastsync"`` and with each of vLLM's own backends, side by side.

Order (each backend gets its own real vLLM-CPU engine, in its own engine-core and worker
processes as ``vllm serve`` runs it, or with ``in_process=True`` inside the bench's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as vLLM's own API tests run); every backend of one run the
same way):

1. the checkpoint (a preset written once with random weights, or a local HF dir) and the trainer:
   the HF model of the same checkpoint, one rank, ``vllm``'s ``ModuleSource`` over it;
2. each of vLLM's own backends (``ipc``, ``nccl``): first its trainer side is tried on this host
   (``WeightTransferTrainerFactory.trainer_init`` with a client that only records calls); where
   it refuses (on CPU both need CUDA) the row says so with its own error and no engine starts;
   where it does not, it runs like the others;
3. each backend that runs: an engine started with ``weight_transfer_config=backend``,
   ``trainer_init`` through :class:`~fastsync.engines.vllm.weight_transfer_trainer.LLMWeightSyncClient`
   (timed), one untimed warm-up update, then ``repeats`` rounds of: change every weight,
   ``send_weights`` (timed: start, update, finish, the whole round trip), check that the engine's
   greedy tokens equal the trainer's and that ``get_weight_version`` is the round's;
4. medians, the model's bytes over the median (GB/s), each backend's median over fastsync's.

``ipc_shm_standin`` (``fastsync.bench.wt_standin``) is vLLM's ``ipc`` engine with a shared-memory
file in place of the CUDA IPC handle: vLLM's own load path (layerwise reload, ``load_weights``),
which is what ``ipc`` costs here apart from the handle.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["PRESETS", "BACKENDS", "run_weight_transfer_bench"]

_COMMON: dict[str, Any] = {"max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                           "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64}

#: preset -> Qwen3 config (awkward sizes: vocabulary and MLP not multiples of 64)
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.3M parameters: the CLI test
    "tiny": {"vocab_size": 500, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 2,
             "num_attention_heads": 3, "num_key_value_heads": 1},
    # ~19M parameters, 78 MB in fp32: big enough that a sync is not all fixed costs
    "small": {"vocab_size": 8003, "hidden_size": 512, "intermediate_size": 1400, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "initializer_range": 0.05},
    # ~155M parameters, 620 MB in fp32: where the bytes, not the calls, cost the time
    "medium": {"vocab_size": 32003, "hidden_size": 1024, "intermediate_size": 2800, "num_hidden_layers": 8,
               "num_attention_heads": 16, "num_key_value_heads": 4, "initializer_range": 0.02},
}

#: backends in the order of the table; fastsync first (the ratios' base)
BACKENDS = ("fastsync", "ipc_shm_standin", "ipc", "nccl")
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123]]
MAX_TOKENS = 6


def preset_checkpoint(model: str, workdir: str) -> str:
    if os.path.isdir(model):
        if not (Path(model) / "config.json").exists():
            raise ConfigError(f"--model {model!r}: no config.json in that directory")
        return model
    if model not in PRESETS:
        raise ConfigError(f"--model {model!r}: not a directory and not a preset ({sorted(PRESETS)})")
    out = Path(workdir) / model
    if not (out / "config.json").exists():
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = transformers.Qwen3Config(**{**_COMMON, **PRESETS[model]})
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(out)
    return str(out)


class _Recorder:
    """A client that only records calls: what a trainer side does before any engine exists."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_info(backend: str) -> Any:
    if backend == "fastsync":
        from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo

        return FastSyncTrainerInitInfo(rank=0, verify="full")  # every byte checked before each flip
    if backend == "ipc_shm_standin":
        from fastsync.bench.wt_standin import ShmIPCTrainerInitInfo

        return ShmIPCTrainerInitInfo(rank=0)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=_free_port(), world_size=2)
    raise ConfigError(f"--backends: unknown backend {backend!r}; known: {list(BACKENDS)}")


def _probe(backend: str, source: Any) -> str | None:
    """None when the trainer side of ``backend`` starts on this host, else its own error."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    try:
        eng = WeightTransferTrainerFactory.trainer_init(_init_info(backend), client=_Recorder(), source=source)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    try:
        eng.shutdown()
    except Exception:
        pass
    return None


def perturb(model: Any, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02 * (p.std() + 1e-3))


def trainer_greedy(model: Any) -> list[list[int]]:
    """The trainer's own greedy continuation of each prompt (full forward per token)."""
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            for _ in range(MAX_TOKENS):
                ids = torch.cat([ids, model(input_ids=ids).logits[0, -1].argmax().view(1, 1)], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def _run_backend(backend: str, ckpt: str, hf: Any, repeats: int, seed0: int) -> dict:
    from fastsync.bench.wt_standin import REGISTRATION, STANDIN

    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.inputs import TokensPrompt

    from fastsync.engines.vllm.weight_transfer_trainer import LLMWeightSyncClient

    t0 = time.perf_counter()
    extra = {"worker_extension_cls": REGISTRATION} if backend == STANDIN else {}
    llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=64 << 20, seed=0, weight_transfer_config=WeightTransferConfig(backend=backend),
              **extra)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def tokens() -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    row: dict[str, Any] = {"runs": True, "engine_start_s": start_s}
    eng = None
    checks: list[bool] = []
    times: list[float] = []
    try:
        t0 = time.perf_counter()
        eng = WeightTransferTrainerFactory.trainer_init(_init_info(backend), client=LLMWeightSyncClient(llm),
                                                        source=ModuleSource(hf))
        row["trainer_init_s"] = time.perf_counter() - t0
        engine_side: list[dict] = []
        for i in range(repeats + 1):  # round 0: warm-up, not timed
            with torch.no_grad():
                perturb(hf, seed0 + i)
            wv = f"{backend}-{i}"
            t0 = time.perf_counter()
            res = eng.send_weights(weight_version=wv)
            dt = time.perf_counter() - t0
            if i and getattr(res, "engines", None):  # fastsync: each worker's own phases
                engine_side.append(res.engines[0][0])
            got, want = tokens(), trainer_greedy(hf)
            checks.append(got == want and llm.get_weight_version() == wv)
            if i:
                times.append(dt)
        row.update(send_s=times, median_s=statistics.median(times), min_s=min(times), verified=all(checks),
                   rounds_verified=f"{sum(checks)}/{len(checks)}",
                   # fastsync: the engine checked a CRC of every byte against the trainer's before each
                   # flip (a mismatch raises), then the tokens; the other backends: tokens only
                   verified_by="bytes+tokens" if backend == "fastsync" else "tokens")
        if engine_side:  # medians of the worker's wait for the writes, repack, whole update call
            row["engine_median_s"] = {k: statistics.median(e[k] for e in engine_side)
                                      for k in ("wait_s", "postprocess_s", "update_s") if k in engine_side[0]}
    except Exception as e:  # it started here and then failed: a failure, not "cannot run here"
        row.update(runs=False, failed=True, why=f"{type(e).__name__}: {e}", stage="engine",
                   rounds_verified=f"{sum(checks)}/{repeats + 1}")
    finally:
        if eng is not None:
            try:
                eng.shutdown()
            except Exception:
                pass
        llm.llm_engine.engine_core.shutdown()
        del llm
    return row


def check_entry_point() -> None:
    """An engine in its own processes finds the backend only through the installed entry point."""
    import importlib.metadata as md

    if not any(ep.value == "fastsync.engines.vllm:register_weight_transfer"
               for ep in md.entry_points(group="vllm.general_plugins")):
        raise ConfigError("vLLM's worker processes will not know backend 'fastsync': the installed fastsync has no "
                          "vllm.general_plugins entry point fastsync_weight_transfer (an install older than it: "
                          "run `pip install -e .` again), or use --in-process")


def run_weight_transfer_bench(model: str = "small", *, backends: tuple[str, ...] = BACKENDS, repeats: int = 5,
                              workdir: str | None = None, in_process: bool = False) -> dict:
    """Run the bench (see the module doc); returns the report the CLI prints."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"--repeats must be an int >= 1, got {repeats!r}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ConfigError(f"--backends: unknown backend(s) {unknown}; known: {list(BACKENDS)}")
    if in_process:  # every backend's engine in this process (see doc); set before the first engine
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    import transformers
    from vllm.distributed.weight_transfer import ModuleSource

    from fastsync.bench.wt_standin import register_standin
    from fastsync.engines.vllm.backend import register_weight_transfer
    from fastsync.security import job_secret

    if not os.path.isdir(model) and model not in PRESETS:
        raise ConfigError(f"--model {model!r}: not a directory and not a preset ({sorted(PRESETS)})")
    if not in_process and "fastsync" in backends:
        check_entry_point()
    job_secret(create=True)  # both sides live here: one secret for the store and the engine
    register_weight_transfer()
    register_standin()
    ckpt = preset_checkpoint(model, workdir or os.path.join(os.path.expanduser("~"), ".cache", "fastsync", "wt-bench"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    nbytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    rows: dict[str, dict] = {}
    for i, b in enumerate(backends):
        why = None if b in ("fastsync", "ipc_shm_standin") else _probe(b, ModuleSource(hf))
        if why is not None:
            rows[b] = {"runs": False, "why": why, "stage": "trainer_init"}
            continue
        rows[b] = _run_backend(b, ckpt, hf, repeats, seed0=100 * (i + 1))
        if rows[b].get("median_s"):
            rows[b]["gbps"] = nbytes / rows[b]["median_s"] / 1e9
    base = rows.get("fastsync", {}).get("median_s")
    ratios = {b: r["median_s"] / base for b, r in rows.items() if base and r.get("median_s")}
    ran = [r for r in rows.values() if r.get("median_s")]
    failed = sorted(b for b, r in rows.items() if r.get("failed"))
    return {"model": model, "checkpoint": ckpt, "params": sum(p.numel() for p in hf.parameters()),
            "bytes": nbytes, "dtype": "float32", "repeats": repeats, "engine": f"vLLM-CPU tp=1, {'in the bench process' if in_process else 'own processes'}",
            "backends": rows, "ratio_to_fastsync": ratios,
            "failed": failed,  # backends that started and then failed an update: the run fails
            "verified": bool(ran) and not failed and all(r.get("verified") for r in ran)}
