"""Calls on the AsyncLLM inside verl's vLLM server actor (``vLLMHttpServer``), on the event loop
its output handler runs on: ask whether it is paused, pause it in one of vLLM's modes, resume it,
and the after-flip steps. ``fastsync_verl.server.ServerEngine`` fences every update with these.

They run through Ray's ``__ray_call__`` (a thread of the actor, not its loop), which schedules the
coroutine on the actor's loop and waits for it with a deadline; verl 0.9.1's own
``abort_all_requests`` cannot be used on vLLM 0.32 (it passes ``wait_for_inflight_requests``, an
argument vLLM no longer has).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from fastsync import SyncError, ray_result

__all__ = ["is_paused", "pause", "resume", "label", "after_flip"]


def _on_engine_loop(server: Any, what: str, coro_fn: Any, timeout_s: float) -> Any:
    """Run ``coro_fn(engine, actor)`` (``engine``: the actor's AsyncLLM; ``actor``: the
    ``vLLMHttpServer`` itself) on the server actor's event loop and return its result, within
    ``timeout_s`` (SyncError naming ``what`` after it, the coroutine cancelled)."""
    def call(self: Any) -> Any:
        engine = getattr(self, "engine", None)
        handler = getattr(engine, "output_handler", None)
        if engine is None or handler is None:
            raise SyncError(f"verl's vLLM server has no running AsyncLLM to {what} (node rank "
                            f"{getattr(self, 'node_rank', '?')}, or the server is not launched)")
        fut = asyncio.run_coroutine_threadsafe(coro_fn(engine, self), handler.get_loop())
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise SyncError(f"verl's vLLM server did not {what} within {timeout_s:.1f} s") from None

    return ray_result(server.__ray_call__.remote(call), timeout_s + 30, f"verl's vLLM server ({what})")


def is_paused(server: Any, timeout_s: float = 60.0) -> bool:
    return bool(_on_engine_loop(server, "ask whether it is paused", lambda e, _: e.is_paused(), timeout_s))


def pause(server: Any, mode: str = "abort", timeout_s: float = 60.0) -> None:
    """Pause AsyncLLM's scheduler in ``mode`` (what each mode does to the requests in flight:
    ``fastsync.engines.vllm.pause``) and check it is paused. ``AsyncLLM.pause_generation``'s
    call, less the 20 ms sleep it adds for the ordering of outputs (stall); caches cleared under
    ``keep`` here, after the flip otherwise (:func:`after_flip`). A pause that fails, runs out
    of time or does not hold resumes (never left paused) and raises."""
    async def run(e: Any, _: Any) -> None:
        await e.engine_core.pause_scheduler_async(mode=mode, clear_cache=mode == "keep")
        if not await e.is_paused():  # checked, never assumed: no write while AsyncLLM schedules
            raise SyncError(f"AsyncLLM still schedules after pausing its scheduler (mode {mode!r})")

    try:
        _on_engine_loop(server, f"pause (mode {mode!r})", run, timeout_s)
    except BaseException:
        resume(server)
        raise


def resume(server: Any, timeout_s: float = 60.0) -> None:
    _on_engine_loop(server, "resume", lambda e, _: e.resume_generation(), timeout_s)


def label(server: Any, steps: int, timeout_s: float = 60.0) -> None:
    """``AsyncLLM.update_weight_version(str(steps))``: every output token from now is labelled so."""
    _on_engine_loop(server, "label its weights", lambda e, _: e.update_weight_version(str(steps)), timeout_s)


def after_flip(server: Any, steps: int | None, resume_it: bool, timeout_s: float = 60.0) -> None:
    """On verl's server actor, in one call: with ``steps`` (the flip happened) verl's
    ``clear_kv_cache`` (prefix / multimodal / encoder caches of the old weights), AsyncLLM's
    ``update_weight_version(str(steps))`` (vLLM labels every output token with it) and verl's
    ``set_global_steps(steps)``; then ``resume_generation`` if ``resume_it`` (this update paused)."""
    async def run(engine: Any, actor: Any) -> None:
        try:
            if steps is not None:
                await actor.clear_kv_cache()
                await engine.update_weight_version(str(steps))
                await actor.set_global_steps(steps)
        finally:
            if resume_it:
                await engine.resume_generation()

    _on_engine_loop(server, "clear caches, label the weights and resume" if steps is not None else "resume",
                    run, timeout_s)
