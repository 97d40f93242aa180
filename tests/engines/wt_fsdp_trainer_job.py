"""One FSDP2 trainer rank (gloo, CPU) driving a ``vllm serve`` engine through vLLM's own
weight-transfer API with ``backend="fastsync"``. Run by tests/engines/test_vllm_weight_transfer_serve.py:

    python wt_fsdp_trainer_job.py RANK WORLD MASTER_PORT URL MODEL_DIR OUT_DIR NUM_VERSIONS

Each version is a real training step (forward, backward, Adam) on the FSDP2 model, then
``send_weights``; then both ranks run the sharded model's greedy decode (a collective) and rank 0
asks the server for its greedy tokens and ``/weight_info``. ``DTensor.full_tensor`` is counted
for the whole run and inside fastsync's calls (``trainer_init``/``send_weights``) alone.
Writes ``rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import urllib.request

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123]]
MAX_TOKENS = 6


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def server_tokens(url: str) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        got = _post(url + "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS,
                                              "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        out.append(list(got["choices"][0]["token_ids"]))
    return out


def main(rank: int, world: int, port: int, url: str, model_dir: str, out_dir: str, num_versions: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from fastsync.demo.run import hf_greedy
    from fastsync.engines.vllm.weight_transfer_trainer import FastSyncTrainerInitInfo

    counts = {"total": 0, "fastsync": 0}
    inside = [False]
    real_full_tensor = DTensor.full_tensor

    def counted_full_tensor(self, *a, **kw):
        counts["total"] += 1
        if inside[0]:
            counts["fastsync"] += 1
        return real_full_tensor(self, *a, **kw)

    DTensor.full_tensor = counted_full_tensor

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    records = []
    model.eval()
    records.append({"version": 0, "trainer": hf_greedy(model, PROMPTS, MAX_TOKENS),
                    "server": server_tokens(url) if rank == 0 else None,
                    "weight_info": _get(url + "/weight_info") if rank == 0 else None})
    # the greedy decode (no backward) leaves FSDP2's root unsharded (reshard_after_forward is False
    # for the root): trainer_init runs in that state
    unsharded_before_init = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    inside[0] = True
    t0 = time.perf_counter()
    engine = WeightTransferTrainerFactory.trainer_init(FastSyncTrainerInitInfo(rank=rank),
                                                       client=HTTPVLLMWeightSyncClient(url),
                                                       source=ModuleSource(model))
    init_s = time.perf_counter() - t0
    inside[0] = False
    plan = engine.ws.plan  # which trainer ranks send each parameter
    senders = {n: sorted({t.src_rank for t in plan.transfers if t.src_param == n})
               for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight")}
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    for v in range(1, num_versions + 1):
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        inside[0] = True
        t0 = time.perf_counter()
        res = engine.send_weights(weight_version=f"step-{v}")
        send_s = time.perf_counter() - t0
        inside[0] = False
        records.append({"version": v, "fastsync_version": res.version, "send_s": send_s, "loss": float(loss),
                        "trainer": hf_greedy(model, PROMPTS, MAX_TOKENS),
                        "server": server_tokens(url) if rank == 0 else None,
                        "weight_info": _get(url + "/weight_info") if rank == 0 else None,
                        "engines": res.engines})
    engine.shutdown()
    # the counter's control: vLLM's own ModuleSource iteration gathers every DTensor (a collective,
    # run by both ranks in the same order)
    model.reshard()  # the decode above left the root unsharded (plain tensors: nothing to gather)
    before = counts["total"]
    for _ in ModuleSource(model):
        pass
    counts["module_source_iteration"] = counts["total"] - before
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": True, "full_tensor_calls": counts, "sharded_params": sharded, "init_s": init_s,
                   "unsharded_before_init": unsharded_before_init, "senders": senders,
                   "records": records}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    rank = int(sys.argv[1])
    try:
        main(rank, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7]))
    except BaseException:
        with open(os.path.join(sys.argv[6], f"rank{rank}.json"), "w") as f:
            json.dump({"ok": False, "error": traceback.format_exc()}, f)
        raise
