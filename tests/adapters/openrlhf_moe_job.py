"""One DeepSpeed ZeRO-3 rank for test_openrlhf_moe.py (spawned, gloo): the actor's HF MoE model is
built partitioned under ``HfDeepSpeedConfig`` (as OpenRLHF's ``Actor`` does), swapped by
``fastsync_openrlhf.moe.patch_actor_model``, then wrapped by ``deepspeed.initialize``; prints one
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
    from fastsync_openrlhf.moe import patch_actor_model

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True}
    dschf = HfDeepSpeedConfig(config)  # noqa: F841 - kept alive: from_pretrained builds under zero.Init
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    partitioned_before = all(hasattr(p, "ds_id") for p in model.parameters())
    swapped = patch_actor_model(model, backend="auto")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=config)
    blocks = sum(isinstance(m, FastSyncMoEBlock) for m in engine.module.modules())
    params = dict(engine.module.named_parameters())
    partitioned_after = all(hasattr(p, "ds_tensor") for p in params.values())
    ref_params = dict(ref.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        same_values = all(torch.equal(params[n].data, ref_params[n].data) for n in ref_params if n in params)
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
        "same_values": same_values, "max_logit_diff": diff, "loss": loss.item(),
    }), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
