"""The check that a layout recorded from vLLM's own loaders equals fastsync's hand-written map (not
a test module): shared by ``test_vllm_recorded`` (bf16 engines) and ``test_vllm_padded``, whose
live float32 engines of the hand-mapped architectures record their layout before they sync (one
engine start per model for both checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastsync.engines.vllm.recorded_map import merge_segments
from fastsync.layout.namemap import NameMap


def canonical(nm: NameMap) -> dict:
    out = {}
    for p in nm.params:
        # parts say how a tensor splits over TP ranks: a replicated one never splits (DeepSeek's
        # fused_qkv_a_proj: the hand map lists its two pieces, vLLM's MergedReplicatedLinear no TP parts)
        parts = () if p.style == "replicated" else tuple((q.size, q.heads if len(p.parts) > 1 else 0) for q in p.parts)
        out[p.name] = (p.shape, p.style, p.shard_dim if p.style in ("column", "row") else 0, parts, p.expert_dim,
                       p.dtype, tuple(merge_segments(list(p.segments))))
    return out


def assert_recorded_equals_hand(got: dict, model_dir: Path, arch: str) -> None:
    """``got``: one worker's ``fastsync_record_layout`` answer for the checkpoint in ``model_dir``
    (an engine of any dtype: a map's tensors carry a dtype only where it is fixed, as DeepSeek's
    router bias in float32)."""
    from fastsync.layout.engine import engine_tensors_for_rank
    from fastsync.layout.namemap import get_name_map
    from fastsync.layout.namemap_wire import name_map_from_json
    from fastsync.models.inventory import inventory_from_config

    assert "error" not in got, got
    assert got["fallback"] == {}
    recorded = name_map_from_json(got["name_map"])
    inv = inventory_from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    hand = get_name_map(arch, inv.config, inv.params)
    print(f"\n{arch}: recorded {len(recorded.params)} engine tensors from {len(got['params'])} checkpoint tensors "
          f"in {got['record_s']:.2f} s")
    assert set(got["params"]) == set(inv.params)  # the trainer's names, from the config
    rc, hc = canonical(recorded), canonical(hand)
    assert sorted(rc) == sorted(hc)
    for name in hc:
        assert rc[name] == hc[name], name
    assert set(recorded.unused) == set(hand.unused)
    assert all(hand.is_engine_only(n) for n in recorded.engine_only), recorded.engine_only
    recorded.validate(inv.params)
    for tp in (2, 3):  # the same per-rank tensors where the hand map splits over TP
        for rank in range(tp):
            try:
                want = engine_tensors_for_rank(inv, hand, tp_size=tp, tp_rank=rank)
            except Exception as e:  # e.g. 7 heads over 2 ranks: the recorded map must refuse too
                with pytest.raises(type(e)):
                    engine_tensors_for_rank(inv, recorded, tp_size=tp, tp_rank=rank)
                continue
            assert engine_tensors_for_rank(inv, recorded, tp_size=tp, tp_rank=rank) == want
