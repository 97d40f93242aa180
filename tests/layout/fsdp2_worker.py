"""Run by tests/layout/test_dtensor.py as a separate process: one FSDP2 rank (gloo, CPU)."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

WORLD = 2
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=5,
           num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           tie_word_embeddings=False)


def _worker(rank: int, port: int, out_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        import torch.distributed as dist
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard as DShard

        from fastsync.layout.box import box_slices
        from fastsync.layout.dtensor import trainer_layout_from_module
        from fastsync.layout.trainer import fsdp_layout, hsdp_layout
        from fastsync.models import inventory_from_config
        from fastsync.plugins import hook

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        cfg = transformers.Qwen3MoeConfig(**CFG)
        inv = inventory_from_config(cfg.to_dict(), dtype="float32")
        mesh = init_device_mesh("cpu", (WORLD,))
        checked = 0
        results = {}
        # HSDP over a 2-D (replicate=2, shard=1) mesh: placements (Replicate(), Shard(0))
        hsdp_mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
        for dim in (0, 1, "hsdp"):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            full = {n: t.detach().clone() for n, t in model.state_dict().items()}
            kw = {} if dim in (0, "hsdp") else {"shard_placement_fn": lambda p, d=dim: DShard(d) if p.ndim > d else DShard(0)}
            m = hsdp_mesh if dim == "hsdp" else mesh
            for layer in model.model.layers:
                fully_shard(layer, mesh=m, **kw)
            fully_shard(model, mesh=m, **kw)

            layout = trainer_layout_from_module(model, rank, WORLD)
            via_hook = hook().fastsync_trainer_layout(model=model, rank=rank, world_size=WORLD)
            expected = hsdp_layout(inv, WORLD, 1) if dim == "hsdp" else fsdp_layout(inv, WORLD, shard_dim=dim)
            if dim == "hsdp":
                placements = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].placements
                assert [type(p).__name__ for p in placements] == ["Replicate", "Shard"], placements
            assert layout.to_json()["shards"] == expected.to_json()["shards"], dim
            assert layout.to_json()["params"] == expected.to_json()["params"]
            assert layout.kind == ("hsdp" if dim == "hsdp" else "fsdp"), layout.kind
            assert via_hook.to_json() == layout.to_json()
            for name, t in model.state_dict().items():
                mine = [s for s in layout.shards[name] if s.rank == rank]
                local = t.to_local() if hasattr(t, "to_local") else t
                if not mine:
                    assert local.numel() == 0, name
                    continue
                assert len(mine) == 1 and mine[0].local_offset == 0
                assert torch.equal(local, full[name][box_slices(mine[0].box)]), (dim, name)
                checked += 1
            results[dim] = [s.box for s in layout.shards["model.layers.0.mlp.experts.gate_up_proj"]]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"ok": True, "checked": checked, "experts": results[0], "experts_dim1": results[1]}, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"ok": False, "error": traceback.format_exc()}, f)
        raise

if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
