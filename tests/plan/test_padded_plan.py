"""Engines pad shapes, without an engine: padding in a dimension other than the first.

vLLM's CPU fused-MoE kernel rounds the intermediate size per partition up to a multiple of 32
and pads gate, up and down each on its own (``cpu_moe.py::_pad_moe_intermediate``): ``w13_weight``
[E, 2I, H] -> [E, 2P, H] with up at rows ``[P, P + I)``, ``w2_weight`` [E, H, I] -> [E, H, P].
Here a tiny Qwen3-MoE with awkward sizes (intermediate 20 -> 32, hidden 40, vocab 130 -> 192)
is planned from FSDP ranks into such padded engine tensors and executed by the reference
executor and by the real sender/receiver programs over NIXL: every logical element lands where
vLLM's own padding puts it, no padding element is ever written, and the plan records both shapes.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.errors import ConfigError, LayoutError, PlanError  # noqa: E402
from fastsync.executor.program import TensorInfo, compile_recv  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.engine import build_engine_layout, engine_tensors_for_rank  # noqa: E402
from fastsync.layout.namemap import get_name_map  # noqa: E402
from fastsync.layout.padding import DimPad, logical_to_engine, pad_tensor  # noqa: E402
from fastsync.layout.trainer import fsdp_layout  # noqa: E402
from fastsync.layout.types import EngineTensor, Piece  # noqa: E402
from fastsync.models import inventory_from_config  # noqa: E402
from fastsync.plan.fingerprint import engine_fingerprint, plan_hash  # noqa: E402
from fastsync.plan.planner import build_plan  # noqa: E402
from fastsync.plan.types import Plan  # noqa: E402
from fastsync.bench.local import execute_plan_locally, split_full_params, write_counts  # noqa: E402
from fastsync_rigs.threads import run_ranks  # noqa: E402

INTER, HIDDEN, EXPERTS = 20, 40, 5
CFG = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 130, "hidden_size": HIDDEN, "intermediate_size": 36,
    "moe_intermediate_size": INTER, "num_experts": EXPERTS, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False,
}
W13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
W2 = "model.layers.0.mlp.experts.routed_experts.w2_weight"
GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
SENTINEL = -7.0


def _round(n: int, m: int = 32) -> int:
    return -(-n // m) * m


def _vllm_pad(gate_up: torch.Tensor, down: torch.Tensor, moe_tp: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent re-implementation of vLLM's loader (TP split of gate and up) followed by
    ``_pad_moe_intermediate`` (zero-pad each part to the next multiple of 32): what the engine
    holds for rank ``r``. Padding is marked with SENTINEL instead of zeros."""
    i = gate_up.shape[1] // 2
    g, u = gate_up[:, :i].chunk(moe_tp, dim=1)[r], gate_up[:, i:].chunk(moe_tp, dim=1)[r]
    d = down.chunk(moe_tp, dim=2)[r]
    il = g.shape[1]
    p = _round(il)
    w13 = torch.full((gate_up.shape[0], 2 * p, gate_up.shape[2]), SENTINEL)
    w13[:, :il], w13[:, p:p + il] = g, u
    w2 = torch.full((down.shape[0], down.shape[1], p), SENTINEL)
    w2[:, :, :il] = d
    return w13, w2


@pytest.fixture(scope="module")
def inv():
    return inventory_from_config(CFG)


@pytest.fixture(scope="module")
def name_map(inv):
    return get_name_map(inv.architecture, inv.config, inv.params)


def _full(inv, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in inv.params.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_tensors_carry_both_shapes_and_pieces_in_padded_coordinates(inv, name_map, tp):
    il, p = INTER // tp, _round(INTER // tp)
    for r in range(tp):
        ts = engine_tensors_for_rank(inv, name_map, tp_size=tp, tp_rank=r, dtype="float32", moe_pad=32)
        w13, w2 = ts[W13], ts[W2]
        assert (w13.logical_shape, w13.shape) == ((EXPERTS, 2 * il, HIDDEN), (EXPERTS, 2 * p, HIDDEN))
        assert (w2.logical_shape, w2.shape) == ((EXPERTS, HIDDEN, il), (EXPERTS, HIDDEN, p))
        # up starts at row P, not at row I: the piece that covered [0, 2I) was split at the boundary
        assert sorted(pc.dst_box[1] for pc in w13.pieces) == [(0, il), (p, p + il)]
        emb = ts["model.embed_tokens.weight"]
        assert emb.shape == (192 // tp, HIDDEN) and (emb.logical_shape or emb.shape)[0] == min(130 - r * 192 // tp, 192 // tp)
        dense = ts["model.layers.0.self_attn.qkv_proj.weight"]
        assert dense.logical_shape is None  # what vLLM does not pad stays as it was
    # without moe_pad the MoE tensors are unpadded (GPU kernels, zentorch): same as before
    ts = engine_tensors_for_rank(inv, name_map, tp_size=tp, tp_rank=0, dtype="float32")
    assert ts[W13].logical_shape is None and ts[W13].shape == (EXPERTS, 2 * il, HIDDEN)


@pytest.mark.parametrize("tp,trainers", [(1, 3), (2, 2)])
def test_plan_writes_the_logical_sub_box_and_never_the_padding(inv, name_map, tp, trainers):
    engine = build_engine_layout(inv, name_map, tp=tp, dtype="float32", moe_pad=32)
    trainer = fsdp_layout(inv.params, trainers)
    plan = build_plan(inv.params, trainer, engine)
    # both shapes recorded per engine rank, for exactly the tensors vLLM pads
    for r in range(tp):
        il, p = INTER // tp, _round(INTER // tp)
        assert plan.padded[r][W13] == ((EXPERTS, 2 * il, HIDDEN), (EXPERTS, 2 * p, HIDDEN))
        assert plan.padded[r][W2] == ((EXPERTS, HIDDEN, il), (EXPERTS, HIDDEN, p))
        assert "model.layers.0.self_attn.o_proj.weight" not in plan.padded[r]
    full = _full(inv)
    out = execute_plan_locally(plan, split_full_params(full, trainer), engine, trainer)
    counts = write_counts(plan, engine)
    for r in range(tp):
        want13, want2 = _vllm_pad(full[GATE_UP], full[DOWN], tp, r)
        for name, want in ((W13, want13), (W2, want2)):
            pad = want == SENTINEL
            assert torch.equal(counts[r][name][pad], torch.zeros_like(counts[r][name][pad]))  # never written
            assert bool((counts[r][name][~pad] == 1).all())  # every logical element once
            assert torch.equal(out[r][name][~pad], want[~pad])


def test_padded_plan_round_trips_and_hashes_with_both_shapes(inv, name_map):
    trainer = fsdp_layout(inv.params, 2)
    padded = build_plan(inv.params, trainer, build_engine_layout(inv, name_map, tp=2, dtype="float32", moe_pad=32))
    plain = build_plan(inv.params, trainer, build_engine_layout(inv, name_map, tp=2, dtype="float32"))
    back = Plan.loads(padded.dumps())
    assert back.padded == padded.padded and back.plan_hash == padded.plan_hash
    assert padded.to_json()["padded"]["0"][W2] == [[EXPERTS, HIDDEN, 10], [EXPERTS, HIDDEN, 32]]
    assert plan_hash(padded) == padded.json_hash() == padded.plan_hash  # the fast hash agrees with the JSON one
    assert padded.plan_hash != plain.plan_hash and padded.engine_hash != plain.engine_hash
    engine = build_engine_layout(inv, name_map, tp=2, dtype="float32", moe_pad=32)
    assert engine_fingerprint(engine) == engine.fingerprint()
    assert padded.padded_shapes(1, W13) == ((EXPERTS, 20, HIDDEN), (EXPERTS, 64, HIDDEN))


def test_receiver_with_the_logical_shape_is_refused_by_name(inv, name_map):
    engine = build_engine_layout(inv, name_map, tp=1, dtype="float32", moe_pad=32)
    plan = build_plan(inv.params, fsdp_layout(inv.params, 2), engine)
    infos = {n: TensorInfo(n, t.shape, t.dtype) for n, t in engine.tensors[0].items()}
    compile_recv(plan, 0, infos)  # the engine's shapes: fine
    infos[W2] = TensorInfo(W2, (EXPERTS, HIDDEN, INTER), "float32")  # an engine that does not pad
    with pytest.raises(PlanError, match=r"w2_weight'.*padded shape \(5, 40, 32\) \(logical \(5, 40, 20\)\)"):
        compile_recv(plan, 0, infos)


def test_pad_tensor_checks_and_refuses_by_name():
    t = EngineTensor("w", (2, 6, 3), "float32", (Piece(((0, 2), (0, 6), (0, 3)), "p", ((0, 2), (0, 6), (0, 3))),))
    got = pad_tensor(t, [DimPad(1, 2, 3, 5)])
    assert got.shape == (2, 10, 3) and got.logical_shape == (2, 6, 3)
    assert [(p.dst_box[1], p.src_box[1]) for p in got.pieces] == [((0, 3), (0, 3)), ((5, 8), (3, 6))]
    assert pad_tensor(t, [DimPad(1, 2, 3, 3)]) is t  # nothing padded: unchanged
    with pytest.raises(LayoutError, match="'w'.*expects dim 1 to hold 2 x 4"):
        pad_tensor(t, [DimPad(1, 2, 4, 5)])
    with pytest.raises(LayoutError, match="'w' is padded already"):
        pad_tensor(got, [DimPad(2, 1, 3, 4)])
    q = EngineTensor("q", (2, 6, 3), "float8_e4m3fn", (Piece(((0, 2), (0, 6), (0, 3)), "p", ((0, 2), (0, 6), (0, 3)), "fp8_block"),))
    with pytest.raises(LayoutError, match="'q'.*split a 'fp8_block' piece"):
        pad_tensor(q, [DimPad(1, 2, 3, 5)])
    with pytest.raises(LayoutError, match="logical <= engine"):
        DimPad(0, 1, 5, 4)
    assert logical_to_engine((2, 6, 3), [DimPad(1, 2, 3, 5)]) == [
        (((0, 2), (0, 3), (0, 3)), ((0, 2), (0, 3), (0, 3))), (((0, 2), (3, 6), (0, 3)), ((0, 2), (5, 8), (0, 3)))]


def test_moe_pad_is_validated(inv, name_map):
    for bad in (0, -32, True, 1.5, 10**6):
        with pytest.raises(ConfigError, match="moe_pad"):
            build_engine_layout(inv, name_map, tp=1, moe_pad=bad)


_ns = itertools.count()


@pytest.mark.parametrize("tp", [1, 2])
def test_sender_and_receiver_programs_over_nixl_leave_the_padding_alone(inv, name_map, tp):
    """The real data plane: WeightSender programs on 2 trainer ranks write over NIXL into
    receivers holding the engine's padded tensors, pre-filled with a sentinel. Bytes land at the
    engine's offsets (up at row P), the sentinel survives in every padding element."""
    pytest.importorskip("nixl._api", reason="NIXL not installed")
    from fastsync.sync.receiver import WeightReceiver
    from fastsync.sync.sender import WeightSender

    engine = build_engine_layout(inv, name_map, tp=tp, dtype="float32", moe_pad=32)
    trainer = fsdp_layout(inv.params, 2)
    plan = build_plan(inv.params, trainer, engine)
    full = _full(inv, seed=3)
    store = TCPStoreControl.server(port=0, timeout_s=20)
    ctl = store.with_prefix(f"pad{next(_ns)}")
    tensors = {r: {n: torch.full(t.shape, SENTINEL) for n, t in engine.tensors[r].items()} for r in range(tp)}
    rxs = [WeightReceiver(rank=r, plan=plan, tensors=tensors[r], control=ctl, transport="nixl", mode="inplace",
                          verify=True, timeout_s=20) for r in range(tp)]
    txs = []
    try:
        for rx in rxs:
            rx.setup()
        locals_ = split_full_params(full, trainer)
        for r in range(2):
            shards = trainer.shards_on(r)
            srcs = {n: locals_[r][n] for n in shards}  # flat local storage, as FSDP holds it
            txs.append(WeightSender(rank=r, plan=plan, sources=srcs, shards=shards, control=ctl, transport="nixl",
                                    staging_bytes=32 << 10, timeout_s=20))
        for tx in txs:
            tx.setup()
        for rx in rxs:
            rx.begin(1)
        # every rank on its own thread, as in separate processes (each agent makes progress)
        got = run_ranks([lambda tx=tx: tx.sync(1) for tx in txs] + [lambda rx=rx: rx.wait() and rx.finish() for rx in rxs],
                        timeout_s=40)
        assert got[len(txs):] == [1] * tp
    finally:
        for x in txs + rxs:
            x.close()
    for r in range(tp):
        want13, want2 = _vllm_pad(full[GATE_UP], full[DOWN], tp, r)
        assert torch.equal(tensors[r][W13], want13) and torch.equal(tensors[r][W2], want2)
        emb, rows = tensors[r]["model.embed_tokens.weight"], 192 // tp
        lo = r * rows
        n = min(130 - lo, rows)
        assert torch.equal(emb[:n], full["model.embed_tokens.weight"][lo:lo + n])
        assert bool((emb[n:] == SENTINEL).all())  # padded vocab rows untouched too



def test_cli_plan_shows_both_shapes(tmp_path, capsys):
    """``fastsync plan`` with ``moepad32`` (vLLM CPU's MoE padding): the table names a padded
    tensor with both shapes, ``--json`` counts them and the padding bytes, ``--save`` keeps them."""
    import json

    from fastsync.cli import main

    (tmp_path / "config.json").write_text(json.dumps(CFG))
    saved = tmp_path / "plan.json"
    argv = ["plan", "--model", str(tmp_path), "--trainer", "fsdp:2", "--rollout", "vllm:tp2,moepad32"]
    assert main(argv + ["--json", "--save", str(saved)]) == 0
    r = json.loads(capsys.readouterr().out)
    # per rank: w13 and w2 of 2 layers (+ lm_head and embed_tokens on rank 1: vocab 130 -> 2 x 96 rows)
    assert r["padded"]["tensors"] == 2 * 4 + 2
    moe = 2 * 2 * EXPERTS * HIDDEN * (2 * (32 - 10) + (32 - 10))  # ranks x layers x (w13 + w2), bf16
    assert r["padded"]["padding_bytes"] == moe * 2 + 2 * (96 - 34) * HIDDEN * 2
    assert Plan.loads(saved.read_text()).padded[1][W2] == ((EXPERTS, HIDDEN, 10), (EXPERTS, HIDDEN, 32))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "engine pads" in out and "w13_weight logical (5, 20, 40) in engine (5, 64, 40)" in out
    assert main(["plan", "--model", str(tmp_path), "--trainer", "fsdp:2", "--rollout", "vllm:tp2,moepad0"]) == 2


def test_rank_whose_vocab_slice_is_all_padding_holds_its_rows_and_gets_nothing():
    """vocab 130 -> 192 at tp 4: 48 rows per rank, rank 3 starts at row 144 > 130. vLLM still
    allocates its 48 rows; the plan writes none of them (and still plans every other rank)."""
    inv = inventory_from_config(dict(CFG, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=24))
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    engine = build_engine_layout(inv, nm, tp=4, dtype="float32")
    emb = engine.tensors[3]["model.embed_tokens.weight"]
    assert (emb.shape, emb.logical_shape, emb.pieces) == ((48, HIDDEN), (0, HIDDEN), ())
    trainer = fsdp_layout(inv.params, 2)
    plan = build_plan(inv.params, trainer, engine)
    assert plan.padded[3]["model.embed_tokens.weight"] == ((0, HIDDEN), (48, HIDDEN))
    assert not [t for t in plan.transfers if t.dst_rank == 3 and t.dst_tensor == "model.embed_tokens.weight"]
    full = _full(inv)
    out = execute_plan_locally(plan, split_full_params(full, trainer), engine, trainer)
    assert torch.equal(out[2]["model.embed_tokens.weight"][:130 - 96], full["model.embed_tokens.weight"][96:])
