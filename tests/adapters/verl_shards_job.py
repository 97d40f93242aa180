"""Trainer-rank process of tests/adapters/test_verl_shards.py (a module of its own so that
multiprocessing's spawn can import it by name)."""

from __future__ import annotations

import asyncio

import torch

A = 2


def _model(seed: int, moe: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.model = torch.nn.Module()
    m.model.embed_tokens = torch.nn.Embedding(203, 40)
    m.model.layers = torch.nn.ModuleList([torch.nn.Linear(40, 75, bias=False), torch.nn.Linear(75, 40, bias=False)])
    m.model.norm = torch.nn.LayerNorm(40)
    m.lm_head = torch.nn.Linear(40, 203, bias=False)
    if moe:  # transformers v5's packed experts: 5 experts, intermediate 7 ([E, 2I, H], [E, H, I])
        m.model.moe = torch.nn.Module()
        m.model.moe.mlp = torch.nn.Module()
        m.model.moe.mlp.experts = torch.nn.Module()
        m.model.moe.mlp.experts.gate_up_proj = torch.nn.Parameter(torch.randn(5, 14, 40))
        m.model.moe.mlp.experts.down_proj = torch.nn.Parameter(torch.randn(5, 40, 7))
    return m


#: LoRA targets of the PEFT case: every attention and MLP projection
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(seed: int, use_rslora: bool = False) -> torch.nn.Module:
    """A tiny Llama with awkward sizes (vocab 203, hidden 40, intermediate 75, 5 heads of 8 over 1
    KV head: k/v_proj have 8 rows) under PEFT LoRA r=8 on q/k/v/o and gate/up/down, B random and
    nonzero (a freshly initialised adapter has B = 0, which would hide a wrong merge)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=203, hidden_size=40, intermediate_size=75, num_hidden_layers=2,
                                   num_attention_heads=5, num_key_value_heads=1, head_dim=8,
                                   tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(cfg)
    pm = get_peft_model(base, LoraConfig(r=8, lora_alpha=12, lora_dropout=0.1, target_modules=LORA_TARGETS,
                                         use_rslora=use_rslora))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.5)
    return pm


def _step(m: torch.nn.Module, k: int) -> None:
    with torch.no_grad():
        for p in m.parameters():  # on local shards under FSDP2: what an optimizer step does
            p.mul_(0.5).add_(0.01 * k)


def _trainer(rank: int, port: int, conn, mode: str) -> None:
    import os

    moe = mode.endswith("+moe")  # a MoE model: packed experts, which verl un-fuses on export
    lora = mode.endswith("+lora")  # a PEFT LoRA actor with verl's lora.merge=True
    mode = mode.removesuffix("+moe").removesuffix("+lora")
    import types

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from fastsync_rigs.verl_cpu import use_cpu_platform

    use_cpu_platform()  # CPU bridge: verl 0.9.1 has no CPU platform (see tests/support/fastsync_rigs/verl_cpu.py)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine  # as in verl's actor process

    import_external_libs("fastsync_verl")  # what checkpoint_engine.custom_backend_module does

    calls = {"full_tensor": 0}
    orig = DTensor.full_tensor

    def counted(self, *a, **kw):
        calls["full_tensor"] += 1
        return orig(self, *a, **kw)

    DTensor.full_tensor = counted
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=A)
        m = _peft_model(7) if lora else _model(7, moe)
        for layer in (m.base_model.model.model.layers if lora else m.model.layers):
            fully_shard(layer)
        fully_shard(m)
        engine = CheckpointEngineRegistry.new("fastsync", is_master=rank == 0, bucket_size=1 << 20,
                                              control_host="127.0.0.1", timeout_s=30, trainer_shards=mode)
        fake = types.SimpleNamespace(  # stand-in for FSDPEngine: what get_per_tensor_param reads
            # LoRA: True skips verl's whole-module staging onto the GPU (load_fsdp_model_to_gpu); none here
            module=m, _uses_fsdp2_cpu_offload_policy=lora, _is_offload_param=False, _qat_enabled=False,
            model_config=types.SimpleNamespace(lora={"merge": True} if lora else {}, hf_config=types.SimpleNamespace(
                model_type="qwen3_moe", num_experts=5) if moe else types.SimpleNamespace(model_type="llama")))
        if lora:  # verl's own merged export (lazy: it merges and gathers only when iterated)
            fake._merged_lora_per_tensor_param = types.MethodType(FSDPEngine._merged_lora_per_tensor_param, fake)
        for k in (1, 2):
            _step(m, k)
            conn.send(engine.prepare())
            kw = conn.recv()
            engine.init_process_group(**kw)
            weights, _ = FSDPEngine.get_per_tensor_param(fake)
            metrics = asyncio.run(engine.send_weights(weights, global_steps=k))
            engine.finalize()
            conn.send({"metrics": metrics, "full_tensor": calls["full_tensor"],
                       "iterated": getattr(weights, "iterated", None), "type": type(weights).__name__})
        # as verl closes its workers: after the whole last sync, not when this rank's part ended
        # (trainer rank 0 holds the control plane, which the other ranks and the rollout still use)
        if conn.poll(120):
            conn.recv()
        engine.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        conn.send({"error": f"{type(e).__name__}: {e}"})


def _lora_refusal(conn) -> None:
    """verl's checkpoint-engine export of an unmerged PEFT actor, handed to fastsync's backend."""
    import types

    try:
        from fastsync_rigs.verl_cpu import use_cpu_platform

        use_cpu_platform()
        from peft import LoraConfig, get_peft_model
        from verl.utils.import_utils import import_external_libs
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        import_external_libs("fastsync_verl")  # what checkpoint_engine.custom_backend_module does
        from fastsync_verl.checkpoint_engine import FastSyncCheckpointEngine

        pm = get_peft_model(_model(3), LoraConfig(r=4, lora_alpha=8, target_modules=["0", "1"]))
        fake = types.SimpleNamespace(module=pm, _uses_fsdp2_cpu_offload_policy=True, _is_offload_param=False,
                                     _qat_enabled=False, model_config=types.SimpleNamespace(
                                         lora={"merge": False}, hf_config=types.SimpleNamespace(model_type="llama")))
        engine = FastSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, control_host="127.0.0.1")
        weights, peft_config = FSDPEngine.get_per_tensor_param(fake)  # wrapped by the backend's install()
        out = {"type": type(weights).__name__, "peft_config": peft_config is not None,
               "names": [n for n, _ in weights]}
        try:
            asyncio.run(engine.send_weights(weights, global_steps=1))
            out["refused"] = ""
        except Exception as e:  # noqa: BLE001
            out["refused"] = f"{type(e).__name__}: {e}"
        finally:
            engine.close()
        full, _ = FSDPEngine.get_per_tensor_param(fake, layered_summon=False, base_sync_done=True)
        out["with_arguments"] = type(full).__name__
        conn.send(out)
    except BaseException as e:  # noqa: BLE001
        conn.send({"error": f"{type(e).__name__}: {e}"})
