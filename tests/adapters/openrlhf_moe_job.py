"""One DeepSpeed ZeRO-3 rank for test_openrlhf_moe.py (spawned, gloo): the actor's HF MoE model is
built partitioned under ``HfDeepSpeedConfig`` (as OpenRLHF's ``Actor`` does), swapped by
``fastsync.patch_moe_partitioned`` (what ``--fastsync.moe`` runs in OpenRLHF's ``Actor``), then wrapped by ``deepspeed.initialize``; prints one
JSON line with what the test checks."""

from __future__ import annotations

import json
import os
import sys


def main(rank: int, world: int, port: int, model_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo")
    import deepspeed
    import torch
    import transformers
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from fastsync.moe.block import FastSyncMoEBlock
    from fastsync import patch_moe_partitioned

    torch.set_num_threads(1)
    # DeepSpeed on CPU JIT-compiles its shared-memory all-reduce op here (45-300 s on 2 cores, again
    # for every venv path, and a run killed mid-build leaves a lock that hangs the next one);
    # only inference_all_reduce uses it, not ZeRO-3 training over gloo: not built
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # stage3_allgather_sequential: DeepSpeed 0.19.6's coalesced gather (partition_parameters.py,
    # _allgather_params_coalesced) launches one async all_gather per parameter and waits only the LAST
    # handle, which is enough on one NCCL stream but not on gloo (ProcessGroupGloo runs async ops on a
    # pool of threads, out of order). A module with two direct parameters (the HF experts module:
    # gate_up_proj, down_proj) then comes out of GatheredParameters with gate_up_proj's buffer still
    # being written: transformers' zero3 loader writes the checkpoint into it on rank 0, the late
    # all_gather overwrites it with zero.Init's stale shards and modifier_rank=0 broadcasts that, so the
    # model is corrupt BEFORE the swap, intermittently. The sequential gather waits every parameter.
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_allgather_sequential": True},
              "zero_allow_untested_optimizer": True}
    dschf = HfDeepSpeedConfig(config)  # noqa: F841 - kept alive: from_pretrained builds under zero.Init
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    partitioned_before = all(hasattr(p, "ds_id") for p in model.parameters())
    swapped = patch_moe_partitioned(model, backend="auto")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=config)
    blocks = sum(isinstance(m, FastSyncMoEBlock) for m in engine.module.modules())
    params = dict(engine.module.named_parameters())
    partitioned_after = all(hasattr(p, "ds_tensor") for p in params.values())
    ref_params = dict(ref.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        differing = {  # name: max abs diff (or the two shapes), for the test's failure message
            n: float((params[n].data - r.data).abs().max()) if params[n].shape == r.shape
            else f"shape {tuple(params[n].shape)} vs {tuple(r.shape)}"
            for n, r in ref_params.items() if n in params and not torch.equal(params[n].data, r.data)
        }
        same_values = not differing
        ids = torch.tensor([[5, 6, 7, 8, 100, 200, 300, 11]])
        with torch.no_grad():
            diff = (engine.module(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    batch = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    print("RESULT " + json.dumps({
        "rank": rank, "partitioned_before": partitioned_before, "swapped": swapped, "blocks": blocks,
        "partitioned_after": partitioned_after, "names_equal": sorted(params) == sorted(ref_params),
        "same_values": same_values, "differing": differing, "max_logit_diff": diff, "loss": loss.item(),
    }), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
