"""The sync matrix's cells and its checks, shared by every entry point's matrix test (not a test
module; issue 21 "Must show").

Every entry point (``WeightSync`` with live vLLM engines, the verl backend, the OpenRLHF adapter,
``fastsync bench``) runs the same four cells: the payload, ``dense`` or ``delta`` (a dense first
sync, then a sparse step sent as a delta), times the route, ``direct`` (every replica written by
the trainer ranks) or ``relayed`` (the first replica written by the trainers, the second fed by a
relay between engine ranks). Relays need at least two identical replicas, so every entry point
runs two. A cell an entry point cannot run today is an ``xfail(strict=True)`` naming what is
missing: it fails loudly the day it works.
"""

from __future__ import annotations

import hashlib
from typing import Any

#: (payload, route) of every cell, in the order the tests run them
CELLS: list[tuple[str, str]] = [("dense", "direct"), ("dense", "relayed"), ("delta", "direct"), ("delta", "relayed")]

#: the ``fanout`` option that asks for each route with two identical replicas
FANOUT = {"direct": "direct", "relayed": "chain"}



def cell_id(cell: tuple[str, str]) -> str:
    return f"{cell[0]}-{cell[1]}"


def cell_params() -> list[Any]:
    """The cells as pytest params."""
    import pytest

    return [pytest.param(cell, id=cell_id(cell)) for cell in CELLS]


def first_version(cell: tuple[str, str]) -> int:
    """Versions only grow on a shared engine: each cell gets its own block of ten."""
    return 10 * (CELLS.index(cell) + 1)


def reference_digest(full: dict[str, Any], tensors_json: dict) -> dict[str, str]:
    """What ``fastsync_digest`` must report for one engine rank whose tensors are ``tensors_json``
    (its ``describe()`` answer): a SHA-256 (16 hex digits) of each engine tensor's plain bytes,
    built piece by piece from the trainer's full weights (``fastsync.bench.local``)."""
    from fastsync.executor.staging import as_bytes
    from fastsync.layout.types import EngineLayout
    from fastsync.layout.wire import engine_tensors_from_json
    from fastsync.bench.local import reference_engine_tensors

    tensors = engine_tensors_from_json(tensors_json)
    want = reference_engine_tensors(full, EngineLayout(1, {0: tensors}))[0]
    return {n: hashlib.sha256(as_bytes(t.contiguous()).numpy().tobytes()).hexdigest()[:16] for n, t in want.items()}


def assert_digest(got: dict[str, str], want: dict[str, str], what: str) -> None:
    assert set(got) == set(want), f"{what}: engine tensors {sorted(set(got) ^ set(want))[:5]} on one side only"
    differ = sorted(n for n in want if got[n] != want[n])
    assert not differ, f"{what}: engine bytes differ from the trainer's for {len(differ)} tensors, e.g. {differ[:5]}"


def sparse_step(full: dict[str, Any], seed: int, frac: float) -> None:
    """Change a fraction ``frac`` of every tensor's elements in place (a delta-sized step)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in full.values():
            mask = torch.rand(t.shape, generator=g) < frac
            t[mask] += torch.randn(int(mask.sum()), generator=g, dtype=t.dtype) * 0.3 * (t.std() + 1e-3)


#: A tiny Qwen3-MoE with awkward sizes for the MoE cells: vocab 211 (vLLM pads it), hidden 96 (not a
#: multiple of 64; vLLM CPU's unquantized MoE kernel, ``CPUUnquantizedExperts``, needs hidden % 32
#: == 0: 88 fails at engine start with "No Unquantized MoE backend supports the deployment
#: configuration"), moe_intermediate 44 (the engine pads its experts to 64), intermediate 100,
#: 5 experts (an odd expert dimension to split), top-2, 6 query heads over 2 KV heads of head_dim 32
#: (vLLM's CPU attention takes 32/64/80/...; 16 fails at the first forward), untied head.
AWKWARD_QWEN3_MOE: dict[str, Any] = {
    "vocab_size": 211, "hidden_size": 96, "intermediate_size": 100, "moe_intermediate_size": 44,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
    "num_experts": 5, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}

#: prompts inside the MoE model's vocabulary (211)
MOE_PROMPTS: list[list[int]] = [[5, 6, 7, 8], [100, 200, 150], [11, 42, 99, 7, 123], [210, 3, 77]]


def build_moe_checkpoint(out_dir: Any, config: dict | None = None, *, seed: int = 0, dtype: str = "float32") -> str:
    """A random-weight ``Qwen3MoeForCausalLM`` ``save_pretrained`` checkpoint of
    :data:`AWKWARD_QWEN3_MOE` (or ``config``) in ``out_dir`` (reused when already there)."""
    import json
    from pathlib import Path

    import torch
    import transformers

    cfg = dict(AWKWARD_QWEN3_MOE if config is None else config)
    out = Path(out_dir)
    stamp = out / "fastsync_matrix_moe.json"
    want = {"config": cfg, "seed": seed, "dtype": dtype}
    if stamp.exists() and json.loads(stamp.read_text()) == want and (out / "config.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).to(getattr(torch, dtype))
    model.save_pretrained(out)
    stamp.write_text(json.dumps(want, sort_keys=True))
    return str(out)
