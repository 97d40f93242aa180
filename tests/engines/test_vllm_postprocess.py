"""The vLLM binding's post-processing undo, in process and without an engine: two plain linear
layers are repacked by vLLM's own CPU post-load step (``UnquantizedLinearMethod``, the real
``dispatch_cpu_unquantized_gemm``), then a third staged parameter's repack raises (its module has
no MoE kernel). Every layer must come back exactly as it was and the error must name the
parameter: this is what keeps a failed flip from leaving half the engine on the new version."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from fastsync.engines.vllm.binding import VllmBinding  # noqa: E402
from fastsync.engines.vllm.worker_state import WorkerState  # noqa: E402
from fastsync.engines.vllm.layout import LiveParam  # noqa: E402
from fastsync.errors import SyncError  # noqa: E402


def _packed_linear(n: int, k: int, seed: int):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    m = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    m.quant_method = UnquantizedLinearMethod()
    m.quant_method.process_weights_after_loading(m)  # as the engine did at load: packed, weight emptied
    return m


def test_failing_repack_puts_every_layer_back():
    a, b = _packed_linear(32, 16, 0), _packed_linear(16, 32, 1)
    broken = torch.nn.Module()
    broken.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 4), requires_grad=False)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    before = {id(m): (m.cpu_linear, m.weight) for m in (a, b)}
    y_a = a.cpu_linear(x, a.weight, None)
    live = {
        "a.weight": LiveParam("a.weight", a, "weight", (32, 16), "float32", "linear_repack"),
        "b.weight": LiveParam("b.weight", b, "weight", (16, 32), "float32", "linear_repack"),
        "moe.w13_weight": LiveParam("moe.w13_weight", broken, "w13_weight", (2, 4, 4), "float32", "moe_repack"),
    }
    st = WorkerState(0, 0, 1, live, {})
    st.staging = {"a.weight": torch.ones(32, 16), "b.weight": torch.ones(16, 32), "moe.w13_weight": torch.ones(2, 4, 4)}
    undo: list = []
    with pytest.raises(SyncError, match=r"post-processing engine parameter 'moe.w13_weight' failed .*AttributeError"):
        VllmBinding(st, None).postprocess(undo, served=0)
    for m in (a, b):
        assert m.cpu_linear is before[id(m)][0] and m.weight is before[id(m)][1]
    assert torch.equal(a.cpu_linear(x, a.weight, None), y_a)  # still the old weights, not the staged ones
    assert torch.equal(broken.w13_weight, torch.zeros(2, 4, 4))
    assert undo == []


def test_successful_repack_serves_the_staged_values():
    a = _packed_linear(32, 16, 0)
    live = {"a.weight": LiveParam("a.weight", a, "weight", (32, 16), "float32", "linear_repack")}
    st = WorkerState(0, 0, 1, live, {})
    st.staging = {"a.weight": torch.full((32, 16), 0.5)}
    undo: list = []
    VllmBinding(st, None).postprocess(undo, served=0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(a.cpu_linear(x, a.weight, None), x @ st.staging["a.weight"].T, atol=1e-4)
    assert len(undo) == 1  # kept until the receiver's flip is final
