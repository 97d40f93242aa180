"""Weight-version stamps on verl's rollout records: which weights generated which tokens.

vLLM 0.32 labels every completion with the weight versions that sampled it
(``CompletionOutput.weight_versions``: spans ``[start, end)`` of output tokens, each labelled with
what ``AsyncLLM.update_weight_version`` last set). The in-place path labels the engine's weights
with verl's ``global_steps`` at connect and at every flip (``fastsync_verl.server``), so a request
that runs across a flip under ``pause_mode=keep`` carries both versions and the index of the first
token of the new one.

verl's ``vLLMHttpServer.generate`` builds ``TokenOutput.extra_fields`` itself and keeps nothing of
vLLM's spans; the one place where the final ``RequestOutput`` and those ``extra_fields`` meet is its
call ``extract_prompt_logprobs(output=final_res, ..., result_dict=extra_fields)``. :func:`install`
wraps that module-level name inside the server actor (once; verl's own function still runs first), and
the wrapper adds:

* ``weight_versions``: ``[[global_steps, first_token_index], ...]`` (vLLM's spans, in verl's units);
* ``min_global_steps`` / ``max_global_steps``: the oldest and newest version that sampled a token:
  verl's own trajectory fields (its ``LLMServerClient.generate`` only ``setdefault``s them from
  ``global_steps``, the version at the request's end, which under ``keep`` is the newer one), read by
  verl's fully-async trainer for its staleness metrics.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install", "stamp", "SERVER_MODULE"]

SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"


def stamp(output: Any, result: dict) -> None:
    """Add the version fields (module doc) of one finished ``RequestOutput`` to ``result``;
    nothing when vLLM gave no spans (an aborted request with no output)."""
    from fastsync import weight_spans

    got = weight_spans(output)
    if not got:
        return
    result["weight_versions"] = got
    steps = [v for v, _ in got if isinstance(v, int)]
    if steps:
        result["min_global_steps"], result["max_global_steps"] = min(steps), max(steps)


def _install_here(server: Any) -> bool:
    """Inside verl's server actor: wrap the module's ``extract_prompt_logprobs`` (idempotent)."""
    import sys

    mod = sys.modules.get(SERVER_MODULE)
    original = getattr(mod, "extract_prompt_logprobs", None)
    if original is None:
        from fastsync import ConfigError

        raise ConfigError(f"{SERVER_MODULE}.extract_prompt_logprobs not found in verl's server: the version "
                          "stamps were built for verl 0.9.x")
    if getattr(original, "fastsync_stamps", False):
        return False

    def extract_prompt_logprobs(output: Any, num_prompt_logprobs: Any, result_dict: dict) -> Any:
        got = original(output=output, num_prompt_logprobs=num_prompt_logprobs, result_dict=result_dict)
        stamp(output, result_dict)
        return got

    extract_prompt_logprobs.fastsync_stamps = True  # type: ignore[attr-defined]
    extract_prompt_logprobs.__wrapped__ = original  # type: ignore[attr-defined]
    mod.extract_prompt_logprobs = extract_prompt_logprobs
    return True


def install(server: Any, timeout_s: float = 60.0) -> bool:
    """Put the stamps on verl's server actor ``server`` (a Ray handle of ``vLLMHttpServer``);
    True if this call installed them, False if they already were."""
    import ray

    return bool(ray.get(server.__ray_call__.remote(_install_here), timeout=timeout_s))
