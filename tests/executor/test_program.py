"""Compiled per-rank programs: splitting, staging offsets, direct runs, receiver expectations."""

from __future__ import annotations

import pytest
import torch

from fastsync.errors import PlanError
from fastsync.executor.pack import Packer
from fastsync.executor.program import TensorInfo, compile_recv, compile_send, split_transfer
from fastsync.layout.box import box_shape, box_slices
from fastsync.plan.planner import build_plan
from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, small_model
from fastsync.plan.types import Plan, Transfer

DIMS = ModelDims(layers=2, hidden=64, q_dim=64, kv_dim=32, experts=4, moe_inter=32, vocab=128)


def _setup(trainers: int = 3, tp: int = 2):
    params = small_model(DIMS)
    tl = fsdp_layout(params, trainers)
    el = engine_layout(params, DIMS, tp=tp, expert_parallel=False)
    return params, tl, el, build_plan(params, tl, el)


def _infos(el):
    return {d: {n: TensorInfo(n, t.shape, t.dtype) for n, t in ts.items()} for d, ts in el.tensors.items()}


def test_split_transfer_pieces_concatenate_to_the_whole() -> None:
    src = torch.arange(6 * 10 * 8, dtype=torch.float32).view(6, 10, 8)
    t = Transfer(0, 0, "x", ((0, 3), (2, 9), (0, 8)), "p", ((1, 4), (2, 9), (0, 8)), "copy", 3 * 7 * 8 * 4)
    pieces = split_transfer(t, 100)  # smaller than one row of 8 floats x 7: splits down to single rows
    assert all(p.nbytes <= 100 or box_shape(p.dst_box)[-1] * 4 > 100 for p in pieces)
    assert sum(p.nbytes for p in pieces) == t.nbytes
    whole = src[box_slices(t.src_box)].reshape(-1)
    got = torch.cat([src[box_slices(p.src_box)].reshape(-1) for p in pieces])
    assert torch.equal(whole, got)
    dst = torch.zeros(3, 9, 8)
    for p in pieces:
        dst[box_slices(p.dst_box)] = src[box_slices(p.src_box)]
    assert torch.equal(dst[box_slices(t.dst_box)], src[box_slices(t.src_box)])


def test_staged_items_fit_their_slot_without_overlap() -> None:
    params, tl, el, plan = _setup()
    for rank in range(3):
        shards = tl.shards_on(rank)
        prog = compile_send(plan, rank, _infos(el), shards=shards,
                            src_dtypes={p: "bfloat16" for p in shards}, staging_bytes=8 << 10, num_slots=2)
        for c in prog.chunks:
            spans = sorted((it.stage_offset, it.stage_offset + it.transfer.nbytes) for it in c.items if not it.direct)
            for (a0, a1), (b0, _) in zip(spans, spans[1:]):
                assert a1 <= b0
            for s, e in spans:
                assert c.slot * prog.slot_bytes <= s and e <= (c.slot + 1) * prog.slot_bytes
        mine = [t for t in plan.transfers if t.src_rank == rank]
        assert prog.bytes_total == sum(t.nbytes for t in mine)
        staged_chunks = [c for c in prog.chunks if c.slot >= 0]
        assert [c.slot for c in staged_chunks] == [i % 2 for i in range(len(staged_chunks))]


def test_packer_bytes_equal_the_destination_boxes() -> None:
    """Direct and staged items, walked through their segments, produce the destination bytes."""
    params, tl, el, plan = _setup()
    infos = _infos(el)
    for rank in range(3):
        shards = tl.shards_on(rank)
        gen = torch.Generator().manual_seed(rank)
        sources = {p: torch.randn(box_shape(sh[0].box), generator=gen).to(torch.bfloat16) for p, sh in shards.items()}
        prog = compile_send(plan, rank, infos, shards=shards, src_dtypes={p: "bfloat16" for p in shards},
                            staging_bytes=16 << 10, min_direct_run_bytes=64)
        assert any(it.direct for c in prog.chunks for it in c.items)
        assert any(not it.direct for c in prog.chunks for it in c.items)
        staging = torch.zeros(prog.staging_bytes, dtype=torch.uint8)
        packer = Packer(prog, staging, sources, shards)
        for c in prog.chunks:
            packer.pack(c)
            for it in c.items:
                t = it.transfer
                dst = torch.zeros(infos[t.dst_rank][t.dst_tensor].nbytes, dtype=torch.uint8)
                for view, off in packer.segment_views(it):
                    dst[off: off + view.numel()] = view
                sh = shards[t.src_param][0]
                local = [(s - o, e - o) for (s, e), (o, _) in zip(t.src_box, sh.box)]
                want = sources[t.src_param][box_slices(tuple(local))]
                got = dst.view(torch.bfloat16).view(infos[t.dst_rank][t.dst_tensor].shape)[box_slices(t.dst_box)]
                assert torch.equal(got.reshape(-1), want.reshape(-1)), (t.dst_tensor, it.direct)


def test_receiver_program_names_the_tensor_it_lacks() -> None:
    params, tl, el, plan = _setup()
    infos = dict(_infos(el)[0])
    victim = sorted(infos)[3]
    del infos[victim]
    with pytest.raises(PlanError, match=victim.replace(".", r"\.")):
        compile_recv(plan, 0, infos)


def test_receiver_program_refuses_a_wrong_size() -> None:
    params, tl, el, plan = _setup()
    infos = dict(_infos(el)[1])
    name = "model.layers.0.self_attn.qkv_proj.weight"
    infos[name] = TensorInfo(name, (infos[name].shape[0] // 2, infos[name].shape[1]), "bfloat16")
    with pytest.raises(PlanError, match="qkv_proj"):
        compile_recv(plan, 1, infos)


def test_sender_refuses_a_receiver_dtype_that_does_not_match_the_plan() -> None:
    params, tl, el, plan = _setup()
    infos = _infos(el)
    name = "model.layers.1.self_attn.o_proj.weight"
    infos[0][name] = TensorInfo(name, infos[0][name].shape, "float32")
    with pytest.raises(PlanError, match="o_proj"):
        compile_send(plan, 0, infos)


def test_every_byte_is_expected_once() -> None:
    params, tl, el, plan = _setup(trainers=4)
    infos = _infos(el)
    for d in range(2):
        prog = compile_recv(plan, d, infos[d])
        seen = {n: torch.zeros(i.nbytes, dtype=torch.int32) for n, i in infos[d].items()}
        for items in prog.by_src.values():
            for it in items:
                for off, n in it.dst_runs:
                    seen[it.transfer.dst_tensor][off: off + n] += 1
        assert all(bool((v == 1).all()) for v in seen.values())


def test_plan_roundtrip_keeps_hash() -> None:
    *_, plan = _setup()
    assert Plan.loads(plan.dumps()).plan_hash == plan.plan_hash


def test_direct_transfers_larger_than_a_batch_go_in_pieces_that_rebuild_them() -> None:
    """With a chunk cap (relayed plans), a direct transfer larger than a batch is split into direct
    pieces in separate chunks (a relay forwards what one batch completes); the pieces' bytes are
    exactly the transfer's, in destination order, and no chunk exceeds the cap."""
    params, tl, el, plan = _setup(trainers=1, tp=1)
    infos = _infos(el)
    shards = tl.shards_on(0)
    sources = {p: torch.randn(box_shape(sh[0].box), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
               for p, sh in shards.items()}
    cap = 4 << 10
    whole = compile_send(plan, 0, infos, shards=shards, src_dtypes={p: "bfloat16" for p in shards},
                         min_direct_run_bytes=64)
    big = [it.transfer for c in whole.chunks for it in c.items if it.direct and it.transfer.nbytes > cap]
    assert big, "the test model needs a direct transfer larger than the cap"
    prog = compile_send(plan, 0, infos, shards=shards, src_dtypes={p: "bfloat16" for p in shards},
                        min_direct_run_bytes=64, max_chunk_bytes=cap)
    assert all(c.nbytes <= cap for c in prog.chunks if c.slot < 0)
    staging = torch.zeros(prog.staging_bytes, dtype=torch.uint8)
    packer = Packer(prog, staging, sources, shards)
    for t in big:
        index = plan.transfers.index(t)
        items = [it for c in prog.chunks for it in c.items if it.index == index]
        assert len({it.chunk for it in items}) > 1 and all(it.direct for it in items)
        dst = torch.zeros(infos[t.dst_rank][t.dst_tensor].nbytes, dtype=torch.uint8)
        for it in items:
            for view, off in packer.segment_views(it):
                dst[off: off + view.numel()] = view
        sh = shards[t.src_param][0]
        local = [(s - o, e - o) for (s, e), (o, _) in zip(t.src_box, sh.box)]
        got = dst.view(torch.bfloat16).view(infos[t.dst_rank][t.dst_tensor].shape)[box_slices(t.dst_box)]
        assert torch.equal(got.reshape(-1), sources[t.src_param][box_slices(tuple(local))].reshape(-1))
