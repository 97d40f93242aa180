"""FSDP2 actor ranks hand fastsync their local shards: no ``full_tensor()`` on any rank.

Two real trainer processes hold a model sharded with FSDP2 ``fully_shard`` over gloo; each runs
verl's own ``FSDPEngine.get_per_tensor_param`` (the export verl's actor worker calls before
``send_weights``, wrapped by ``fastsync_verl.shards.install``) on that module and hands the result to
the ``fastsync`` backend. The object passed as the engine's ``self`` is a stand-in holding only the
attributes that method reads (the module, offload flags, model config); verl's full FSDPEngine needs
an optimizer, a device mesh config and a checkpoint. The rollout rank runs in this process; the
process group is built by the same calls verl's CheckpointEngineManager makes. Sizes are awkward
(vocab 203, hidden 40, rows 75) so shards are uneven.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest
import torch

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl's FSDP engine does not import")
pytest.importorskip("nixl._api", reason="NIXL not installed")

from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402

import fastsync_verl  # noqa: E402,F401
from fastsync.errors import ConfigError  # noqa: E402
from fastsync.procs import rank_context  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the rank context hands sys.path to the children
from verl_shards_job import A, LORA_TARGETS, _lora_refusal, _model, _peft_model, _step, _trainer  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str) -> tuple[list[dict], list[list[tuple[str, torch.Tensor]]]]:
    ctx = rank_context()
    port = _free_port()
    pipes = [ctx.Pipe() for _ in range(A)]
    procs = [ctx.Process(target=_trainer, args=(r, port, pipes[r][1], mode)) for r in range(A)]
    for p in procs:
        p.start()
    rollout = CheckpointEngineRegistry.new("fastsync", bucket_size=1 << 20, control_host="127.0.0.1", timeout_s=30)
    reports: list[dict] = []
    got: list[list[tuple[str, torch.Tensor]]] = []
    try:
        backend = CheckpointEngineRegistry.get("fastsync")
        for _ in (1, 2):
            meta = []
            for parent, _ in pipes:
                assert parent.poll(180), "trainer process did not report"
                msg = parent.recv()
                assert "error" not in msg, msg
                meta.append(msg)
            a_kw, r_kw = backend.build_topology(A, 1, meta + [rollout.prepare()])
            for i, (parent, _) in enumerate(pipes):
                parent.send({k: v[i] for k, v in a_kw.items()})
            rollout.init_process_group(**{k: v[0] for k, v in r_kw.items()})

            async def collect():
                return [(n, t.clone()) async for n, t in rollout.receive_weights()]
            try:
                got.append(asyncio.run(collect()))
            finally:
                rollout.finalize()
            step = []
            for parent, _ in pipes:
                assert parent.poll(60), "trainer process did not finish the sync"
                step.append(parent.recv())
            reports.append(step)
        for parent, _ in pipes:  # the last sync is over on every rank: now they may close
            parent.send("close")
    finally:
        rollout.close()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return reports, got


@pytest.mark.slow
def test_fsdp2_shards_land_bit_identical_without_full_tensor() -> None:
    reports, got = _run("on")
    want = _model(7)
    for k, (step, received) in enumerate(zip(reports, got), start=1):
        _step(want, k)
        assert not [r for r in step if "error" in r], step
        assert all(r["type"] == "ShardedWeights" and r["iterated"] is False for r in step), step
        assert [r["full_tensor"] for r in step] == [0, 0]  # no rank gathered any parameter
        assert all(r["metrics"][f"fastsync/trainer{i}/from_shards"] == 1.0 for i, r in enumerate(step))
        sd = want.state_dict()
        assert [n for n, _ in received] == list(sd)  # verl's order (state_dict order)
        for n, t in received:
            assert torch.equal(t, sd[n]), n
        sent = [r["metrics"][f"fastsync/trainer{i}/sent_bytes"] for i, r in enumerate(step)]
        assert min(sent) > 0 and sum(sent) == sum(t.nbytes for t in sd.values()), sent


@pytest.mark.slow
def test_off_uses_verls_full_tensors_and_still_delivers() -> None:
    reports, got = _run("off")
    want = _model(7)
    for k, (step, received) in enumerate(zip(reports, got), start=1):
        _step(want, k)
        assert not [r for r in step if "error" in r], step
        assert all(r["full_tensor"] > 0 for r in step)  # the full-tensor path: every rank gathers
        sd = want.state_dict()
        for n, t in received:
            assert torch.equal(t, sd[n]), n


@pytest.mark.slow
def test_moe_full_copy_path_sends_verls_unfused_names() -> None:
    """A MoE model (packed experts [E, 2I, H] / [E, H, I], sharded 3 + 2 over the expert dimension)
    on the full-copy path (the rollout takes named tensors for verl's loader): the rollout gets
    exactly what verl's own export yields, its un-fused per-expert names
    (``unfuse_moe_params``), from verl's full tensors; the in-place path plans the packed ones
    (tests/adapters/test_verl_smoke.py)."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    reports, got = _run("auto+moe")
    want = _model(7, moe=True)
    for k, (step, received) in enumerate(zip(reports, got), start=1):
        _step(want, k)
        assert not [r for r in step if "error" in r], step
        assert all(r["full_tensor"] > 0 for r in step)  # verl's full tensors feed this path for MoE
        expected = list(unfuse_moe_params(want.state_dict().items(), "qwen3_moe"))
        assert [n for n, _ in received] == [n for n, _ in expected]
        assert "model.moe.mlp.experts.4.down_proj.weight" in dict(received)
        for (n, t), (_, w) in zip(received, expected):
            assert torch.equal(t, w), n


@pytest.mark.slow
def test_merged_lora_actor_sends_its_shards_merged_locally() -> None:
    """verl's ``lora.merge=True`` on a PEFT actor (tiny Llama with awkward sizes, LoRA r=8 on
    q/k/v/o and gate/up/down, B random and nonzero), FSDP2 over 2 ranks: each rank sends its own
    rows of every base weight with the adapter merged on that rank, under verl's merged-export
    names; no rank gathers a base weight (``full_tensor()`` 0); only the adapters' A matrices
    are gathered (FSDP2 splits B's rows as it splits W's); the bytes that land are PEFT's own
    ``merge_and_unload()`` weights, bit for bit, after each of 2 steps."""
    import copy

    from verl.utils.fsdp_utils import normalize_peft_param_name

    reports, got = _run("on+lora")
    want = _peft_model(7)
    a_bytes = sum(p.nbytes for n, p in want.named_parameters() if ".lora_A." in n)
    assert a_bytes == 2 * (6 * 8 * 40 + 8 * 75) * 4  # 2 layers; o_proj's input is 5 x 8, down_proj's 75
    for k, (step, received) in enumerate(zip(reports, got), start=1):
        _step(want, k)
        assert not [r for r in step if "error" in r], step
        assert all(r["type"] == "ShardedWeights" and r["iterated"] is False for r in step), step
        assert [r["full_tensor"] for r in step] == [0, 0]  # no rank gathered any parameter with full_tensor()
        for i, r in enumerate(step):
            assert r["metrics"][f"fastsync/trainer{i}/from_shards"] == 1.0
            assert r["metrics"][f"fastsync/trainer{i}/lora_gathered_bytes"] == a_bytes  # A only, never W nor B
        merged = copy.deepcopy(want).merge_and_unload().state_dict()
        # verl's merged export names: the PEFT model's state dict through normalize_peft_param_name
        assert [n for n, _ in received] == list(normalize_peft_param_name(want.state_dict())) == list(merged)
        assert not [n for n, _ in received if "lora" in n or "base_layer" in n]
        for n, t in received:
            assert torch.equal(t, merged[n]), n
        base = want.state_dict()
        assert all(not torch.equal(merged[n], base["base_model.model." + n.replace(f"{t}.", f"{t}.base_layer.")])
                   for n in merged for t in LORA_TARGETS if f".{t}." in n)  # the adapter changed every target
        sent = [r["metrics"][f"fastsync/trainer{i}/sent_bytes"] for i, r in enumerate(step)]
        assert min(sent) > 0 and sum(sent) == sum(t.nbytes for t in merged.values()), sent


def test_bad_trainer_shards_value_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="trainer_shards"):
        CheckpointEngineRegistry.new("fastsync", bucket_size=1 << 20, trainer_shards="yes")


def test_on_without_shards_refuses_naming_the_reason() -> None:
    engine = CheckpointEngineRegistry.new("fastsync", bucket_size=1 << 20, trainer_shards="on")
    with pytest.raises(ConfigError, match="trainer_shards='on'.*list"):
        engine._shard_module([("w", torch.zeros(3))], 0)


@pytest.mark.slow
def test_unmerged_lora_actor_is_refused_by_name_not_synced_as_its_base() -> None:
    """verl 0.9's checkpoint-engine call, ``get_per_tensor_param()``, on a PEFT actor (not merged)
    yields the base weights without the adapter (``collect_lora_params`` with
    ``base_sync_done=False``) and verl drops the ``peft_config``: the rollout would serve the
    untrained base. The real verl method runs on a real PEFT model (no FSDP; the stand-in engine
    holds only what the method reads) in a process of its own (verl's CPU bridge patches the
    process); fastsync's backend refuses it before any byte moves, naming verl's key to set.
    verl's own calls with arguments (its colocated path) are left untouched."""
    pytest.importorskip("peft")
    ctx = rank_context()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_lora_refusal, args=(child,))
    p.start()
    try:
        assert parent.poll(180), "the LoRA process did not report"
        got = parent.recv()
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert "error" not in got, got
    assert got["type"] == "AdapterDropped" and got["peft_config"]
    assert got["names"] and not [n for n in got["names"] if "lora" in n]  # verl's own export: the base only
    assert got["refused"].startswith("ConfigError: fastsync trainer rank 0: the actor is a LoRA model (r=4")
    assert "actor_rollout_ref.model.lora.merge=True" in got["refused"]
    assert got["with_arguments"] != "AdapterDropped"  # verl's colocated adapter sync: untouched
