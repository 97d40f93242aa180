"""Trainer ranks on threads of the test process, driving a ``vllm serve`` through vLLM's own
trainer API (``WeightTransferTrainerFactory.trainer_init`` with ``HTTPVLLMWeightSyncClient``),
for the pause-mode tests of test_vllm_weight_transfer_serve.py (not a test module).

Every rank holds the whole HF model (a plain module: fastsync's planner splits the writes among
the ranks, so each rank writes its own part and the version lands only when every rank wrote);
one rank can be held back (``delays``) or left out (``ranks``) to make the writes land late or
never, while a request streams from the server.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class ThreadTrainers:
    def __init__(self, url: str, model_dir: str, *, world: int = 2, **info: Any) -> None:
        import torch
        import transformers
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

        from fastsync.bench.wt_serve import free_port
        from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo
        from fastsync_rigs.threads import run_ranks

        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        port = free_port()

        def init(r: int) -> Any:
            return WeightTransferTrainerFactory.trainer_init(
                FastSyncTrainerInitInfo(rank=r, world_size=world, control_port=port, **info),
                client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(self.hf))

        self.engines = run_ranks([lambda r=r: init(r) for r in range(world)], 240.0)
        self.world = world

    @property
    def rank0(self) -> Any:
        return self.engines[0]

    def step(self, seed: int, scale: float = 0.05) -> None:
        """A training step's worth of change in every parameter (every rank holds this model)."""
        import torch

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.hf.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * (p.std() + 1e-3))

    def send(self, label: str, *, delays: dict[int, float] | None = None, ranks: tuple[int, ...] | None = None,
             timeout_s: float = 240.0) -> list[Any]:
        """``send_weights(weight_version=label)`` on ``ranks`` (default: all), rank r after
        ``delays[r]`` seconds; each rank's result or exception."""
        ranks = tuple(range(self.world)) if ranks is None else ranks
        out: dict[int, Any] = {}

        def go(r: int) -> None:
            time.sleep((delays or {}).get(r, 0.0))
            try:
                out[r] = self.engines[r].send_weights(weight_version=label)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                out[r] = e

        threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in ranks]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout_s)
        assert not any(th.is_alive() for th in threads), "a trainer rank did not return from send_weights"
        return [out[r] for r in ranks]

    def shutdown(self) -> None:
        for e in self.engines:
            try:
                e.shutdown()
            except Exception:
                pass


class InFlight:
    """A long greedy request streaming from the server on its own thread."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        from fastsync.bench.wt_serve import generate

        self.box: dict = {}
        self.thread = threading.Thread(target=lambda: self.box.update(c=generate(url, prompt, max_tokens)),
                                       daemon=True)
        self.thread.start()

    def result(self, timeout_s: float = 300.0) -> dict:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the request in flight did not finish"
        return self.box["c"]
