"""Expert parallelism over gloo (EP=2, EP=4: spawned processes on 127.0.0.1, with a deadline)
against a single-process reference: the unpatched HF model run on each rank's micro-batch in turn,
gradients summed over micro-batches (what data parallelism over the EP ranks computes)."""

from __future__ import annotations

import pytest
import torch

from fastsync.moe.ep_run import spawn_ep
from moe_equiv import assert_close, run, tiny_model

pytestmark = pytest.mark.slow  # spawns 4 processes (about 20 s here): make test runs it, make test-fast does not

#: (arch, EP size, experts kernel)
RUNS = [("qwen3_moe", 2, "torch"), ("qwen3_moe", 4, "auto"), ("deepseek_v3", 2, "auto"), ("gpt_oss", 4, "torch")]
SEED = 3


def _ids(world: int) -> torch.Tensor:
    return torch.randint(0, 64, (world * 2, 10), generator=torch.Generator().manual_seed(SEED + world))


@pytest.fixture(scope="module")
def ep_results() -> dict:
    runs = [{"arch": a, "world": w, "seed": SEED, "ids": _ids(w), "backend": b} for a, w, b in RUNS]
    per_rank = spawn_ep({"fn": "moe_ep_jobs:multi_job", "runs": runs}, world=4, timeout_s=200)
    return {i: [per_rank[r][i] for r in range(w)] for i, (_, w, _) in enumerate(RUNS)}


def _reference(arch: str, ids: torch.Tensor, world: int):
    ref = tiny_model(arch, SEED)
    per = ids.shape[0] // world
    outs, grads = [], {}
    for r in range(world):
        o, g = run(ref, ids[r * per : (r + 1) * per])
        outs.append(o)
        for k, v in g.items():
            grads[k] = grads[k] + v if k in grads else v
    return ref, outs, grads


@pytest.mark.parametrize("i", range(len(RUNS)), ids=[f"{a}-ep{w}-{b}" for a, w, b in RUNS])
def test_ep_matches_single_process(ep_results: dict, i: int) -> None:
    arch, world, _ = RUNS[i]
    results = ep_results[i]
    ref, ref_outs, ref_grads = _reference(arch, _ids(world), world)
    for r, res in enumerate(results):  # logits, loss, aux loss of each rank's micro-batch
        assert_close({k: res[k] for k in ref_outs[r]}, ref_outs[r])
    # every gradient: expert shards gathered, replicated parameters summed over ranks
    assert_close(results[0]["grads"], ref_grads)
    # state_dict(): HF names, full shapes, the original weights
    want, got = ref.state_dict(), results[0]["state_dict"]
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    # each rank holds 1/world of the routed-expert parameters
    expert_keys = [k for k in want if ".experts." in k]
    full = sum(want[k].numel() * want[k].element_size() for k in expert_keys)
    for res in results:
        assert res["expert_param_bytes"] * world == full
        assert sorted(res["local_shapes"]) == sorted(expert_keys)
        for k, shape in res["local_shapes"].items():
            assert shape[0] * world == want[k].shape[0], k
