"""Trainer ranks on threads of the test process, driving a ``vllm serve`` through vLLM's own
trainer API (``WeightTransferTrainerFactory.trainer_init`` with ``HTTPVLLMWeightSyncClient``),
for the pause-mode tests of test_vllm_weight_transfer_serve.py (not a test module).

Every rank holds the whole HF model (a plain module: fastsync's planner splits the writes among
the ranks, so each rank writes its own part and the version lands only when every rank wrote);
one rank can be held back (``holds``: until an event, such as a request's first token) or left
out (``ranks``) to make the writes land late or never, while a request streams from the server.
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

    def send(self, label: str, *, holds: dict[int, threading.Event] | None = None,
             ranks: tuple[int, ...] | None = None, timeout_s: float = 240.0) -> list[Any]:
        """``send_weights(weight_version=label)`` on ``ranks`` (default: all), rank r once
        ``holds[r]`` is set; each rank's result or exception."""
        ranks = tuple(range(self.world)) if ranks is None else ranks
        out: dict[int, Any] = {}

        def go(r: int) -> None:
            try:
                hold = (holds or {}).get(r)
                assert hold is None or hold.wait(timeout_s / 2), f"trainer rank {r}'s hold was never released"
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
    """A long greedy request streaming from the server on its own thread; ``first`` is set at its
    first token."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, first: threading.Event | None = None) -> None:
        from fastsync.bench.wt_serve import generate

        self.box: dict = {}
        self.first = threading.Event() if first is None else first
        self.thread = threading.Thread(
            target=lambda: self.box.update(c=generate(url, prompt, max_tokens, on_token=self.first.set)), daemon=True)
        self.thread.start()

    def result(self, timeout_s: float = 300.0) -> dict:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the request in flight did not finish"
        return self.box["c"]


class UpdateRequests:
    """Requests started at two points of trainer rank 0's next update, hooked on its engine handle
    (the handle's own calls run right after the hooks; :meth:`restore` takes the hooks off):

    * ``during`` tokens, started as the update begins (right after ``begin_update``): it streams
      while the writes land; ``streaming`` is set at its first token, so a trainer rank held until
      then (``ThreadTrainers.send(holds=...)``) lands its writes only after that token;
    * ``crossing`` tokens, started when every write landed, just before the pause; the pause waits
      for its first token, so it comes while the request decodes, however fast the engine decodes
      against how long the update took (a loaded host slows the update more than the decode).
    """

    def __init__(self, handle: Any, url: str, prompt: list[int], *, during: int = 0, crossing: int = 0,
                 first_token_s: float = 60.0) -> None:
        self.handle, self.pauser = handle, handle.pauser
        self.during: InFlight | None = None
        self.crossing: InFlight | None = None
        self.streaming = threading.Event()
        begin = handle.begin_update

        def begin_update(*args: Any, **kwargs: Any) -> Any:
            token = begin(*args, **kwargs)  # the update's record (its start time) exists from here
            if during and self.during is None:
                self.during = InFlight(url, prompt, during, first=self.streaming)
            return token

        def before_pause() -> None:
            if crossing and self.crossing is None:
                self.crossing = InFlight(url, prompt, crossing)
                assert self.crossing.first.wait(first_token_s), f"no token of the crossing request in {first_token_s} s"

        handle.begin_update = begin_update
        handle.pauser = self.hooked = _PauseAfter(self.pauser, before_pause)

    def restore(self) -> None:
        del self.handle.begin_update  # the instance's hook: the class's method again
        self.handle.pauser = self.pauser

    def crossing_timeline(self) -> str:
        """When the crossing request's first and last tokens came against the pause call (for a
        test's message): seconds from the first token."""
        if self.crossing is None or "c" not in self.crossing.box:
            return "no crossing request"
        arrived, sent = self.crossing.box["c"]["arrived"], self.hooked.sent
        t0 = arrived[0] if arrived else float("nan")
        return (f"{len(arrived)} tokens; first chunk {sum(t == t0 for t in arrived)} tokens; pause sent at "
                f"{(sent or float('nan')) - t0:+.3f} s, last token at {arrived[-1] - t0 if arrived else float('nan'):+.3f} s")

    def results(self) -> tuple[dict | None, dict | None]:
        """The ``during`` and ``crossing`` requests' completions (None for one not started)."""
        return tuple(None if r is None else r.result() for r in (self.during, self.crossing))  # type: ignore[return-value]


class _PauseAfter:
    """The engine handle's pauser, ``before()`` run first in ``pause``."""

    def __init__(self, inner: Any, before: Any) -> None:
        self.inner, self.before = inner, before
        self.sent: float | None = None  # time.time() the pause call went out, after before()

    def pause(self, mode: str, timeout_s: float) -> None:
        self.before()
        self.sent = time.time()
        self.inner.pause(mode, timeout_s)

    def resume(self, timeout_s: float) -> None:
        self.inner.resume(timeout_s)

    def is_paused(self, timeout_s: float) -> bool:
        return self.inner.is_paused(timeout_s)
