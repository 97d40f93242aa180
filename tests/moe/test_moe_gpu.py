"""GPU-only paths: torch grouped_mm on CUDA, TransformerEngine swaps, DeepEP dispatch (two GPUs).
Skipped with a reason on machines without CUDA (this project's CPU machines), and where
TransformerEngine or DeepEP and a second GPU are missing."""

from __future__ import annotations

import pytest
import torch

import fastsync.moe as fm
from fastsync.moe.dispatch import deep_ep_import_error
from fastsync.moe.ep_run import spawn_ep
from fastsync.moe.te import te_import_error
from moe_equiv import assert_close, clone, run, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_cuda_grouped_mm_matches_stock(arch: str) -> None:
    ref = tiny_model(arch).cuda()
    fast = clone(ref)
    fm.patch(fast, backend="auto")
    assert fast.model.layers[0].mlp.experts.kernel == "grouped_mm"
    want_out, want_grad = run(ref, _ids())
    got_out, got_grad = run(fast, _ids())
    assert_close(got_out, want_out, rel=1e-4)  # TF32-free fp32 GEMMs differ in summation order
    assert_close(got_grad, want_grad, rel=1e-4)


@pytest.mark.skipif(te_import_error() is not None, reason=f"TransformerEngine cannot run: {te_import_error()}")
def test_te_swaps_shared_expert_linears_keeping_names() -> None:
    ref = tiny_model("qwen2_moe", hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64).cuda()
    fast = clone(ref)
    fm.patch(fast, backend="te")
    shared = fast.model.layers[0].mlp.shared_expert
    assert type(shared.gate_proj).__module__.startswith("transformer_engine")
    assert list(fast.state_dict()) == list(ref.state_dict())
    want_out, want_grad = run(ref, _ids())
    got_out, got_grad = run(fast, _ids())
    assert_close(got_out, want_out, rel=1e-3)
    assert_close(got_grad, want_grad, rel=1e-3)


@pytest.mark.skipif(deep_ep_import_error() is not None or torch.cuda.device_count() < 2,
                    reason=f"DeepEP needs deep_ep and >= 2 GPUs: {deep_ep_import_error() or 'fewer than 2 GPUs'}")
def test_deepep_dispatch_matches_all_to_all() -> None:
    """EP=2 over NCCL, one process per GPU: a tiny Qwen3-MoE in bf16 patched with DeepEP's
    dispatch/combine against the same model patched with the all-to-all dispatcher (whose
    equivalence to HF's model the CPU EP tests check): each rank's logits, loss and aux loss, and
    every gradient (expert shards gathered, replicated parameters summed), within bf16's 5e-2
    relative (routing is identical: it runs before dispatch, in the same code)."""
    world = 2
    ids = torch.randint(0, 64, (world * 2, 16), generator=torch.Generator().manual_seed(5))
    per_rank = spawn_ep({"fn": "moe_ep_jobs:deepep_job", "arch": "qwen3_moe", "seed": 3, "ids": ids,
                         "dist_backend": "nccl"}, world=world, timeout_s=300)
    for res in per_rank:
        assert res["deepep"]["dispatch"] == ["deepep"]  # not silently the all-to-all path
        assert res["all_to_all"]["dispatch"] == ["all_to_all"]
        keys = [k for k in ("logits", "loss", "aux_loss") if k in res["all_to_all"]]
        assert_close({k: res["deepep"][k] for k in keys}, {k: res["all_to_all"][k] for k in keys}, rel=5e-2)
        assert res["deepep"]["expert_param_bytes"] == res["all_to_all"]["expert_param_bytes"]
    assert_close(per_rank[0]["deepep"]["grads"], per_rank[0]["all_to_all"]["grads"], rel=5e-2)
