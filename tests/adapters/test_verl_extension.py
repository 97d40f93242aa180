"""The composed vLLM worker extension (fastsync's + verl's) against verl 0.9.1's real classes:
verl's vLLM rollout package imports on the CPU build through a dist-info shim made here (verl not
edited), the composed class keeps verl's extension (its ``__new__`` patches, its weight path) and
adds fastsync's calls, vLLM's CPU worker accepts it as an extension (no attribute clash, the check
vLLM itself runs), and a wrong ``worker_extension_cls`` is refused naming the key."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip("verl", reason="verl not installed")

from fastsync_rigs.verl_cpu import vllm_dist_shim  # noqa: E402


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    vllm_dist_shim(str(tmp_path_factory.mktemp("vllmdist")))
    from fastsync_verl import extension

    return extension


def test_composed_extension_keeps_verls_and_adds_fastsyncs(ext) -> None:
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    from fastsync.engines.vllm.extension import FastSyncWorkerExtension

    cls = ext.FastSyncVerlWorkerExtension
    assert issubclass(cls, vLLMColocateWorkerExtension) and issubclass(cls, FastSyncWorkerExtension)
    assert cls.__new__ is vLLMColocateWorkerExtension.__new__  # verl's patches still run
    for name in ("update_weights_from_ipc", "fastsync_describe", "fastsync_connect", "fastsync_update",
                 "fastsync_version"):
        assert callable(getattr(cls, name)), name
    assert ext.EXTENSION_PATH == f"{cls.__module__}.{cls.__qualname__}"


def test_vllms_cpu_worker_accepts_it_without_a_clash(ext) -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker

    clash = [a for a in dir(ext.FastSyncVerlWorkerExtension) if not a.startswith("__") and hasattr(CPUWorker, a)]
    assert clash == []  # vLLM asserts exactly this when it appends the extension to the worker's bases


def test_wrong_extension_is_refused_naming_the_key(ext) -> None:
    from fastsync.errors import ConfigError

    ext.check_extension(ext.EXTENSION_PATH)
    with pytest.raises(ConfigError, match=r"worker_extension_cls='verl\.workers.*is not fastsync_verl"):
        ext.check_extension(ext.VERL_EXTENSION_PATH)
    with pytest.raises(ConfigError, match="worker_extension_cls is not set"):
        ext.check_extension(None)
    with pytest.raises(ConfigError, match="cannot be imported"):
        ext.check_extension("nowhere.Nothing")
