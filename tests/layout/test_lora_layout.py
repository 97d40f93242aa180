"""The LoRA slot recording decoded into pieces, without an engine: vLLM's set_lora rules
(row-parallel A by input columns, column-parallel B by output rows) replayed by hand on
recording tensors, and what must be refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fastsync.errors import LayoutError  # noqa: E402
from fastsync.layout.lora import LoraSource, peft_source_name, pieces_from_recording, recording_inputs  # noqa: E402
from fastsync.layout.types import EngineTensor, ParamSpec, Piece  # noqa: E402
from fastsync.plan.lora import lora_plan  # noqa: E402


def _slot(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.float64)


def test_row_parallel_a_by_input_columns_rank_1_of_2():
    srcs = [LoraSource("m.o_proj.lora_A", (8, 10)), LoraSource("m.o_proj.lora_B", (6, 8))]
    a, _ = recording_inputs(srcs)
    slot = _slot(16, 5)  # max_rank 16, input 10 / tp 2
    slot[:8, :5] = a[:, 5:10]
    (rows, cols), pieces = pieces_from_recording("o.a", slot, srcs)
    assert (rows, cols) == (8, 5)
    assert [(p.dst_box, p.src, p.src_box) for p in pieces] == [(((0, 8), (0, 5)), "m.o_proj.lora_A", ((0, 8), (5, 10)))]


def test_column_parallel_b_by_output_rows_with_padding_rank():
    srcs = [LoraSource("m.up.lora_A", (12, 7)), LoraSource("m.up.lora_B", (10, 12))]
    _, b = recording_inputs(srcs)
    slot = _slot(5, 16)  # output 10 / tp 2, max_rank 16 > r 12
    slot[:5, :12] = b[5:10]
    (rows, cols), pieces = pieces_from_recording("up.b", slot, srcs)
    assert (rows, cols) == (5, 12)
    assert [(p.dst_box, p.src_box) for p in pieces] == [(((0, 5), (0, 12)), ((5, 10), (0, 12)))]


def test_two_boxes_of_one_source_in_one_slice_are_refused():
    """An unpacked fused qkv (one B, rows of q, k and v of this rank) is two or more boxes of one
    source: refused by name rather than mis-planned (not supported yet)."""
    srcs = [LoraSource("qkv.lora_A", (4, 7)), LoraSource("qkv.lora_B", (12, 4))]
    _, b = recording_inputs(srcs)
    slot = _slot(9, 16)
    slot[:3, :4] = b[3:6]
    slot[3:6, :4] = b[9:12]
    slot[6:9, :4] = b[0:3]
    with pytest.raises(LayoutError, match="qkv.b"):
        pieces_from_recording("qkv.b", slot, srcs)


def test_transposed_copy_is_refused():
    srcs = [LoraSource("x.lora_A", (4, 4)), LoraSource("x.lora_B", (4, 4))]
    a, _ = recording_inputs(srcs)
    slot = _slot(4, 4)
    slot[:, :] = a.t()
    with pytest.raises(LayoutError, match="not a box of it copied in order"):
        pieces_from_recording("x.a", slot, srcs)


def test_gap_in_corner_is_refused():
    srcs = [LoraSource("x.lora_A", (2, 2)), LoraSource("x.lora_B", (2, 2))]
    a, _ = recording_inputs(srcs)
    slot = _slot(4, 4)
    slot[0, 0] = a[0, 0]
    slot[1, 1] = a[1, 1]
    with pytest.raises(LayoutError, match="corner"):
        pieces_from_recording("x.a", slot, srcs)


def test_peft_names():
    assert peft_source_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "model.layers.0.self_attn.q_proj.lora_A"
    assert peft_source_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.other.weight") is None
    assert peft_source_name("base_model.model.model.layers.0.mlp.down_proj.base_layer.weight") is None


def test_plan_refuses_a_source_the_trainer_lacks_and_an_unread_one():
    src = "m.q_proj.lora_A"
    t = EngineTensor("m.qkv.a.0", (4, 8), "float32", (Piece(((0, 4), (0, 8)), src, ((0, 4), (0, 8))),))
    with pytest.raises(LayoutError, match="does not have"):
        lora_plan({}, {0: {t.name: t}})
    params = {src: ParamSpec(src, (4, 8), "float32"), "m.k_proj.lora_A": ParamSpec("m.k_proj.lora_A", (4, 8), "float32")}
    with pytest.raises(LayoutError, match="no engine LoRA layer reads"):
        lora_plan(params, {0: {t.name: t}})
    plan = lora_plan({src: params[src]}, {0: {t.name: t}})
    assert sum(x.nbytes for x in plan.transfers) == 4 * 8 * 4


def test_lora_layers_unwrapped_shows_the_base_weights_as_vllm_loaded_them():
    """vLLM's LoRA wrappers put a layer under ``.base_layer``; inside ``lora_layers_unwrapped``
    the model has its loaded names and the very same tensors, and the wrappers come back after."""
    pytest.importorskip("vllm")
    from vllm.lora.layers import BaseLayerWithLoRA

    from fastsync.engines.vllm.lora_record import lora_layers_unwrapped

    class Wrapper(BaseLayerWithLoRA):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base

    inner = torch.nn.Linear(3, 2)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].proj = Wrapper(inner)
    model.norm = torch.nn.LayerNorm(2)
    wrapper = model.layers[0].proj
    assert "layers.0.proj.base_layer.weight" in dict(model.named_parameters())
    with lora_layers_unwrapped(model) as m:
        names = dict(m.named_parameters())
        assert names["layers.0.proj.weight"] is inner.weight and "layers.0.proj.base_layer.weight" not in names
        assert "norm.weight" in names
    assert model.layers[0].proj is wrapper
    with pytest.raises(RuntimeError), lora_layers_unwrapped(model):
        raise RuntimeError("a failed describe")
    assert model.layers[0].proj is wrapper
