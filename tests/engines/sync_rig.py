"""A live vLLM CPU engine plus two trainer ranks of fastsync, for engine tests (not a test module).

``SyncRig(model_dir, tp=..., **llm_kwargs)`` starts ``vllm.LLM`` with the fastsync worker extension
on ``model_dir`` (float32, so greedy tokens are not at the mercy of bf16 near-ties), loads the same
checkpoint into transformers as the trainer, gives two trainer ranks (threads, each with its own
NIXL agent) FSDP2-style row shards of it and sets up one ``WeightSync``. ``step(seed)`` changes
every weight, ``sync()`` writes it, ``digests()`` are the engine's per-rank SHA-256 per parameter.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123], [400, 3, 77]]
MAX_TOKENS = 6
TIMEOUT_S = 60.0


class SyncRig:
    """One live engine on ``model_dir`` (extra ``vllm.LLM`` arguments in ``llm_kwargs``), the HF
    model that plays the trainer (float32), two trainer ranks with FSDP2-style row shards."""

    def __init__(self, model_dir: str, *, tp: int, **llm_kwargs: Any) -> None:
        import transformers
        from vllm import LLM

        from fastsync.control import TCPStoreControl
        from fastsync.demo.run import engine_kwargs
        from fastsync.engines.vllm.handle import VllmEngine
        from fastsync.layout.box import box_slices
        from fastsync.layout.trainer import fsdp_layout
        from fastsync.layout.types import ParamSpec
        from fastsync.sync import WeightSync

        self.dir = model_dir
        t0 = time.perf_counter()
        self.llm = LLM(**engine_kwargs(self.dir, tp, "float32"), **llm_kwargs)
        print(f"\n{os.path.basename(model_dir)} tp={tp} {llm_kwargs}: engine start {time.perf_counter() - t0:.1f} s")
        self.engine = VllmEngine(self.llm)
        self.control = TCPStoreControl.server(port=0)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32).eval()
        self.full = {n: p.data for n, p in self.hf.named_parameters()}
        self.layout = fsdp_layout({n: ParamSpec(n, tuple(t.shape), "float32") for n, t in self.full.items()}, 2)
        self._slices = box_slices
        self.sources = [{n: self.full[n][box_slices(s.box)].clone() for n, ss in self.layout.shards_on(r).items()
                         for s in ss} for r in range(2)]
        self.ws = [WeightSync(rank=r, world_size=2, control=self.control.with_prefix("fb"),
                              engines=[self.engine] if r == 0 else [], transport="nixl", timeout_s=TIMEOUT_S,
                              layout=self.layout, sources=self.sources[r], name="fb", control_port=self.control.port)
                   for r in range(2)]
        t0 = time.perf_counter()
        self.run([lambda r=r: self.ws[r].setup() for r in range(2)])
        print(f"set-up {time.perf_counter() - t0:.1f} s")
        self.version = 0

    @staticmethod
    def run(fns: list, timeout_s: float = TIMEOUT_S * 2) -> list:
        from fastsync_rigs.threads import run_ranks

        return run_ranks(fns, timeout_s)

    def step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in self.full.values():
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.05 * (t.std() + 1e-3))
            for r in range(2):
                for n, ss in self.layout.shards_on(r).items():
                    self.sources[r][n].copy_(self.full[n][self._slices(ss[0].box)])

    def sync(self, ranks: tuple[int, ...] = (0, 1), timeout_s: float = TIMEOUT_S) -> list:
        self.version += 1
        return self.run([lambda r=r: self.ws[r].sync(self.version, timeout_s=timeout_s) for r in ranks],
                        timeout_s=timeout_s + 30)

    def digests(self) -> list[dict]:
        got = self.llm.collective_rpc("fastsync_digest")
        assert all("error" not in g for g in got), got
        return [g["tensors"] for g in got]

    def loaded_digests(self, tmp: str, version: int) -> list[dict]:
        """What vLLM's own loader makes of the trainer's weights: they are saved as a checkpoint and
        read by ``model.load_weights`` into this engine (``fastsync_load_checkpoint``, then the same
        repack), and every parameter is digested again per rank."""
        self.hf.save_pretrained(tmp)
        loaded = self.llm.collective_rpc("fastsync_load_checkpoint", args=(tmp, version))
        assert all("error" not in g for g in loaded), loaded
        return self.digests()

    def close(self) -> None:
        import psutil

        for w in self.ws:
            w.close()
        self.llm.collective_rpc("fastsync_close")
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except psutil.NoSuchProcess:
            pass
