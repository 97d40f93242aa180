"""Weight-version stamps on verl's rollout records: which weights generated which tokens.

vLLM 0.32 stamps every completion with the weight versions that sampled it
(``CompletionOutput.weight_versions``); the in-place path labels the engine's weights with verl's
``global_steps`` at connect and every flip (``fastsync_verl.server``). verl's
``vLLMHttpServer.generate`` keeps nothing of vLLM's spans; the one place where the final
``RequestOutput`` meets verl's ``TokenOutput.extra_fields`` is its call
``extract_prompt_logprobs(output=final_res, ..., result_dict=extra_fields)``, which :func:`install`
wraps inside the server actor (verl's own function still runs first) to add ``weight_versions``
(``[[global_steps, first token index], ...]``) and verl's own ``min_global_steps`` /
``max_global_steps`` (its client only ``setdefault``s them from the end-of-request version, the
newer one under ``keep``; verl's fully-async trainer reads them for its staleness metrics).
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

    from fastsync import wrap_hook_point

    def make(original: Any) -> Any:
        def extract_prompt_logprobs(output: Any, num_prompt_logprobs: Any, result_dict: dict) -> Any:
            got = original(output=output, num_prompt_logprobs=num_prompt_logprobs, result_dict=result_dict)
            stamp(output, result_dict)
            return got

        return extract_prompt_logprobs

    return wrap_hook_point(sys.modules.get(SERVER_MODULE), "extract_prompt_logprobs", make,
                           who=f"fastsync_verl stamps ({SERVER_MODULE}, built for verl 0.9.x)")


def install(server: Any, timeout_s: float = 60.0) -> bool:
    """Put the stamps on verl's server actor ``server`` (a Ray handle of ``vLLMHttpServer``);
    True if this call installed them, False if they already were."""
    import ray

    return bool(ray.get(server.__ray_call__.remote(_install_here), timeout=timeout_s))
