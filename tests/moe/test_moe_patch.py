"""fastsync.moe.patch on one process: every supported architecture's outputs, loss (with the
router aux loss) and every gradient match the stock HF model (eager experts) within 1e-5
relative, in fp32, with random weights; names and shapes stay HF's; bad input is refused."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fastsync.moe as fm
from fastsync import plugins
from fastsync.errors import MoEPatchError
from fastsync.hookspecs import hookimpl
from fastsync.moe.experts import grouped_mm_available, register_transformers_backend
from moe_equiv import assert_close, clone, run, tiny_model

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"]
HF_BLOCK = {
    "qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock",
    "deepseek_v3": "DeepseekV3MoE", "gpt_oss": "GptOssMLP",
}


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
@pytest.mark.parametrize("arch", ARCHS)
def test_patched_matches_stock(arch: str, backend: str) -> None:
    if backend == "grouped_mm" and not grouped_mm_available():
        pytest.skip("this torch has no grouped_mm")
    ref = tiny_model(arch)
    fast = clone(ref)
    swapped = fm.patch(fast, backend=backend)
    assert swapped and set(swapped.values()) == {HF_BLOCK[arch]}
    for name in swapped:
        block = fast.get_submodule(name)
        assert type(block).__name__ == f"FastSync{HF_BLOCK[arch]}"
        assert isinstance(block, type(ref.get_submodule(name)))  # HF isinstance checks still hold
    want_out, want_grad = run(ref, _ids())
    got_out, got_grad = run(fast, _ids())
    assert_close(got_out, want_out)
    assert_close(got_grad, want_grad)
    if arch != "deepseek_v3":
        assert "aux_loss" in got_out  # router logits still reach HF's load-balancing loss
    # names, shapes and order of state_dict() are HF's, and values are shared (no copy)
    sd_ref, sd_fast = ref.state_dict(), fast.state_dict()
    assert list(sd_fast) == list(sd_ref)
    assert all(sd_fast[k].shape == sd_ref[k].shape for k in sd_ref)


def test_patched_shares_parameters_without_ep() -> None:
    model = tiny_model("qwen3_moe")
    before = {n: p for n, p in model.named_parameters()}
    fm.patch(model, backend="torch")
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(after[n] is before[n] for n in before)  # an optimizer built earlier still sees them


def test_patched_model_trains_like_stock() -> None:
    """Three SGD steps: the same weights, step by step."""
    ref = tiny_model("qwen2_moe")
    fast = clone(ref)
    fm.patch(fast, backend="torch")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, fast)]
    for step in range(3):
        for m, opt in zip((ref, fast), opts):
            opt.zero_grad()
            m(input_ids=_ids(step), labels=_ids(step)).loss.backward()
            opt.step()
    assert_close(dict(fast.named_parameters()), dict(ref.named_parameters()))


def test_logs_one_line_naming_the_backend(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("mixtral")
    with caplog.at_level(logging.INFO, logger="fastsync.moe"):
        fm.patch(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastsync.moe"]
    assert len(lines) == 1
    assert "backend='auto'" in lines[0] and "kernel='grouped_mm'" in lines[0] and "TransformerEngine=off" in lines[0]


def test_auto_falls_back_to_loop_where_grouped_mm_cannot_run_and_explicit_request_is_refused() -> None:
    """grouped_mm needs 16-byte row strides: intermediate size 6 (fp32) cannot; "auto" runs the
    per-expert loop there (still equal to stock), an explicit "grouped_mm" is a patch-time error."""
    ref = tiny_model("qwen3_moe", moe_intermediate_size=6)
    fast = clone(ref)
    fm.patch(fast)
    assert fast.model.layers[0].mlp.experts.kernel == "torch"
    want_out, want_grad = run(ref, _ids())
    got_out, got_grad = run(fast, _ids())
    assert_close(got_out, want_out)
    assert_close(got_grad, want_grad)
    with pytest.raises(MoEPatchError, match=r"grouped_mm cannot run these experts: .*not multiples of 4"):
        fm.patch(clone(ref), backend="grouped_mm")


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_backward_from_a_broadcast_gradient(backend: str) -> None:
    """``out.sum().backward()`` sends a stride-0 gradient (HF's grouped_mm path fails on it on CPU)."""
    ref = tiny_model("mixtral")
    fast = clone(ref)
    fm.patch(fast, backend=backend)
    grads = []
    for m in (ref, fast):
        m.zero_grad()
        m(input_ids=_ids()).logits.sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert_close(grads[1], grads[0])


def test_unsupported_block_left_untouched_with_warning() -> None:
    class OddMoE(nn.Module):  # a sparse-MoE block class fastsync does not know
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.Module()
            self.experts.w = nn.Parameter(torch.zeros(4, 8, 8))

    model = tiny_model("qwen3_moe")
    model.model.layers[1].mlp = OddMoE()
    with pytest.warns(UserWarning, match="OddMoE is not a supported MoE block; left untouched"):
        swapped = fm.patch(model, backend="torch")
    assert list(swapped) == ["model.layers.0.mlp"]
    assert type(model.model.layers[1].mlp) is OddMoE


def test_plugin_can_decline_a_block() -> None:
    """The hook decides: a plugin returning a module wins (firstresult); the swap goes through it."""
    seen = []

    class KeepAsIs:
        @hookimpl(tryfirst=True)
        def fastsync_swap_moe(self, module, name, config, ep_group, backend):
            seen.append((name, backend, config is not None))
            return module if name.endswith("1.mlp") else None

    name = plugins.register_plugin(KeepAsIs(), name="test-keep-as-is")
    try:
        model = tiny_model("qwen3_moe")
        original = model.model.layers[1].mlp
        fm.patch(model, backend="torch")
    finally:
        plugins.unregister_plugin(name)
    assert model.model.layers[1].mlp is original
    assert type(model.model.layers[0].mlp).__name__ == "FastSyncQwen3MoeSparseMoeBlock"
    assert seen == [("model.layers.0.mlp", "torch", True), ("model.layers.1.mlp", "torch", True)]


def test_bad_backend_name_refused() -> None:
    with pytest.raises(MoEPatchError, match="unknown MoE backend 'cutlass'"):
        fm.patch(tiny_model("qwen3_moe"), backend="cutlass")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(("backend", "match"), [("te", "backend='te' requested but"), ("deepep", "backend='deepep' requested but")])
def test_te_and_deepep_refused_where_they_cannot_run(backend: str, match: str) -> None:
    model = tiny_model("qwen3_moe")
    before = type(model.model.layers[0].mlp)
    with pytest.raises(MoEPatchError, match=match):
        fm.patch(model, backend=backend)
    assert type(model.model.layers[0].mlp) is before  # nothing swapped


def test_ep_size_not_dividing_experts_refused_before_any_swap() -> None:
    """ep_size=3 over 8 experts: refused at patch time, no block swapped (real gloo group of 3
    is not needed to reach the check: a group object reporting size 3 is the stand-in here)."""
    import torch.distributed as dist

    class GroupOfThreeStandIn:  # stand-in for a 3-rank ProcessGroup: only its size is read
        pass

    real = dist.get_world_size
    dist.get_world_size = lambda group=None: 3 if isinstance(group, GroupOfThreeStandIn) else real(group)
    try:
        model = tiny_model("qwen3_moe")
        with pytest.raises(MoEPatchError, match="ep_size=3 does not divide num_experts=8"):
            fm.patch(model, ep_group=GroupOfThreeStandIn(), backend="torch")
    finally:
        dist.get_world_size = real
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)


def test_experts_interface_backend() -> None:
    """Registered as transformers' experts_implementation="fastsync": same results as eager."""
    register_transformers_backend()
    ref = tiny_model("gpt_oss")
    fast = clone(ref)
    fast.set_experts_implementation("fastsync")
    want_out, want_grad = run(ref, _ids())
    got_out, got_grad = run(fast, _ids())
    assert_close(got_out, want_out)
    assert_close(got_grad, want_grad)


def test_routing_replay() -> None:
    """Record routes, then replay them: unchanged weights give identical logits; after the router
    moves, the experts still get the recorded indices; a call with no recorded route is refused."""
    model = tiny_model("qwen3_moe")
    replay = fm.RoutingReplay()
    fm.patch(model, backend="torch", replay=replay)
    ids = _ids()
    replay.record()
    with torch.no_grad():
        base = model(input_ids=ids).logits
    routes = replay.routes()
    assert sorted(routes) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert routes["model.layers.0.mlp"][0].shape == (24, 2)

    replay.replay(routes)
    with torch.no_grad():
        again = model(input_ids=ids).logits
    assert torch.allclose(again, base, rtol=1e-6, atol=1e-6)

    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.add_(torch.randn_like(block.gate.weight))
    seen = {}
    def keep(key: str, pick):
        def hook(module, inputs, output) -> None:  # returns None: observes, does not replace
            seen.setdefault(key, pick(inputs, output))
        return hook

    hooks = [
        block.gate.register_forward_hook(keep("router_idx", lambda i, o: o[2])),
        block.experts.register_forward_hook(keep("experts_idx", lambda i, o: i[1])),
    ]
    replay.replay(routes)
    try:
        model(input_ids=ids).logits.sum().backward()
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(seen["experts_idx"], routes["model.layers.0.mlp"][0])
    assert not torch.equal(seen["router_idx"], seen["experts_idx"])  # the moved router alone would differ
    assert block.gate.weight.grad is not None  # weights at the replayed experts come from the router
    with pytest.raises(MoEPatchError, match="no recorded route for block 'model.layers.0.mlp' call 1"):
        model(input_ids=ids)
