"""The engine-side layout check and the small host-side helpers, without starting an engine.

The live-engine behaviour (prepacked CPU weights detected, repacked after a sync) is covered by
``test_vllm_sync.py`` against the real vLLM CPU engine.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fastsync.host.replies import raise_worker_errors  # noqa: E402
from fastsync.engines.vllm.layout import (  # noqa: E402
    LiveParam,
    check_against,
    read_live_params,
)
from fastsync.errors import ConfigError, FastSyncError, LayoutError, SyncError  # noqa: E402
from fastsync.layout.engine import engine_tensors_for_rank  # noqa: E402
from fastsync.layout.engine_json import engine_tensors_from_json, engine_tensors_to_json  # noqa: E402
from fastsync.layout.namemap import get_name_map  # noqa: E402
from fastsync.models.inventory import inventory_from_config  # noqa: E402
from fastsync.demo.checkpoints import tiny_config  # noqa: E402


def _expected(tp: int = 2, rank: int = 1) -> dict:
    arch, cfg = tiny_config("tiny-qwen3-moe")
    cfg = {**cfg, "architectures": [arch]}
    inv = inventory_from_config(cfg, dtype="bfloat16")
    return engine_tensors_for_rank(inv, get_name_map(arch, cfg), tp_size=tp, tp_rank=rank, dtype="bfloat16")


def _live_from(expected: dict) -> dict[str, LiveParam]:
    """Plain tensors of exactly the expected local shapes, as a correct engine would hold."""
    m = torch.nn.Module()
    out = {}
    for name, t in expected.items():
        p = torch.nn.Parameter(torch.zeros(t.shape, dtype=torch.bfloat16), requires_grad=False)
        attr = name.replace(".", "_")
        m.register_parameter(attr, p)
        out[name] = LiveParam(name, m, attr, tuple(p.shape), "bfloat16", "inplace")
    return out


def test_matching_engine_passes_and_tp_halves_fused_tensors():
    exp = _expected()
    check_against(_live_from(exp), exp, rank=1)
    full = _expected(tp=1, rank=0)
    q = "model.layers.0.self_attn.qkv_proj.weight"
    assert exp[q].shape[0] * 2 == full[q].shape[0]
    o = "model.layers.0.self_attn.o_proj.weight"
    assert exp[o].shape[1] * 2 == full[o].shape[1]


@pytest.mark.parametrize("how", ["missing", "extra", "shape", "dtype"])
def test_disagreement_names_the_parameter(how):
    exp = _expected()
    live = _live_from(exp)
    name = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    if how == "missing":
        del live[name]
    elif how == "extra":
        live["model.layers.1.mlp.shared_expert.weight"] = live[name]
        name = "model.layers.1.mlp.shared_expert.weight"
    elif how == "shape":
        lp = live[name]
        live[name] = LiveParam(name, lp.module, lp.attr, (lp.shape[0], lp.shape[1] * 2, lp.shape[2]), lp.dtype, lp.kind)
    else:
        lp = live[name]
        live[name] = LiveParam(name, lp.module, lp.attr, lp.shape, "float16", lp.kind)
    with pytest.raises(LayoutError, match=name.replace(".", r"\.")):
        check_against(live, exp, rank=1)


def test_engine_tensors_json_roundtrip():
    exp = _expected()
    assert engine_tensors_from_json(engine_tensors_to_json(exp)) == exp


def test_plain_module_params_are_inplace():
    lin = torch.nn.Linear(4, 3)
    got = read_live_params(lin)
    assert {n: (lp.shape, lp.kind) for n, lp in got.items()} == {"weight": ((3, 4), "inplace"), "bias": ((3,), "inplace")}


def test_worker_errors_come_back_as_their_class():
    with pytest.raises(LayoutError, match="describe: bad shape"):
        raise_worker_errors([{"ok": 1}, {"error": ["LayoutError", "bad shape"]}], "describe")
    with pytest.raises(FastSyncError, match="x: boom"):
        raise_worker_errors([{"error": ["NotAFastSyncError", "boom"]}], "x")
    assert raise_worker_errors([1, 2], "x") == [1, 2]


def test_weightsync_refuses_bad_arguments():
    from fastsync.sync import WeightSync

    with pytest.raises(ConfigError, match="rank 0 only"):
        WeightSync(torch.nn.Linear(2, 2), rank=1, world_size=2, control=None, engines=[object()])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="layout= and sources="):
        WeightSync(rank=0, world_size=1, control=None, layout=object())  # type: ignore[arg-type]
    ws = WeightSync(torch.nn.Linear(2, 2), rank=0, world_size=1, control=None)  # type: ignore[arg-type]
    with pytest.raises(SyncError, match="before setup"):
        ws.sync(1)
