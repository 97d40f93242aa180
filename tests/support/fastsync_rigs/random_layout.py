"""Random small real-architecture models and layout specs, for property tests.

Every config drawn here is a valid HF ``config.json`` of one of the built-in architectures
(Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3), small enough to materialise on a CPU, and every
spec drawn for it builds (heads divide the tensor-parallel sizes drawn, or are replicated the way
vLLM replicates KV heads). Two ways in:

* plain ``random.Random``: :func:`random_config`, :func:`random_trainer_spec`,
  :func:`random_engine_spec`, :func:`random_case`;
* hypothesis (imported lazily): :func:`configs` and :func:`cases` strategies.

Example::

    rng = random.Random(7)
    inv, trainer_spec, engine_spec = random_case(rng)
    trainer = trainer_layout_from_spec(trainer_spec, inv)
    engine = engine_layout_from_spec(engine_spec, inv)
"""

from __future__ import annotations

import random as _random
from typing import Any

from fastsync.errors import LayoutError
from fastsync.models.archs import ARCHITECTURES
from fastsync.models.inventory import Inventory, inventory_from_config
from fastsync.layout.types import FP8_BLOCK

__all__ = ["random_config", "random_trainer_spec", "random_engine_spec", "random_case", "configs", "cases"]

TP_SIZES = (1, 2, 4)


def _gqa(rng: _random.Random, block: int) -> dict:
    heads = rng.choice([4, 8])
    kv = rng.choice([k for k in (1, 2, 4) if heads % k == 0])
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": rng.choice([8, 16]) if block == 1 else 128,
        "hidden_size": rng.choice([16, 32, 48]) if block == 1 else rng.choice([128, 256]),
    }


def random_config(rng: _random.Random, *, architecture: str | None = None, fp8_friendly: bool = False) -> dict:
    """A small valid config. ``fp8_friendly`` draws dims that are multiples of 128 where vLLM's
    block-FP8 needs them (bigger tensors: about 1-10 M elements)."""
    arch = architecture or rng.choice(sorted(ARCHITECTURES))
    if arch not in ARCHITECTURES:
        raise LayoutError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    block = FP8_BLOCK if fp8_friendly else 1
    step = 128 if fp8_friendly else 8
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "vocab_size": rng.randrange(64, 400) if not fp8_friendly else rng.choice([256, 500, 1000]),
        "num_hidden_layers": rng.randint(1, 3),
        "intermediate_size": step * rng.randint(2, 8) if block == 1 else 512,
        "tie_word_embeddings": rng.random() < 0.25,
        "torch_dtype": rng.choice(["bfloat16", "float32"]),
    }
    if arch == "DeepseekV3ForCausalLM":
        heads = rng.choice([4, 8])
        cfg.update({
            "hidden_size": rng.choice([32, 64]) if block == 1 else 256,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "q_lora_rank": rng.choice([None, 24 if block == 1 else 256]),
            "kv_lora_rank": 16 if block == 1 else 128,
            "qk_rope_head_dim": 8 if block == 1 else 64,
            "qk_nope_head_dim": 8 if block == 1 else 64,
            "v_head_dim": rng.choice([8, 12]) if block == 1 else 128,
            "n_routed_experts": rng.choice([4, 6, 8]),
            "n_shared_experts": rng.choice([1, 2]),
            "moe_intermediate_size": step * rng.randint(1, 3) if block == 1 else 512,
            "first_k_dense_replace": rng.randint(0, 1),
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": rng.choice(["noaux_tc", "greedy"]),
        })
        if cfg["q_lora_rank"] is None and block == 128:
            cfg["q_lora_rank"] = 256
        return cfg
    cfg.update(_gqa(rng, block))
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        cfg["attention_bias"] = rng.random() < 0.3 and not fp8_friendly
    elif arch == "Qwen3MoeForCausalLM":
        cfg.update({
            "num_experts": rng.choice([4, 6, 8]),
            "num_experts_per_tok": 2,
            "moe_intermediate_size": step * rng.randint(1, 4) if block == 1 else 512,
            "decoder_sparse_step": rng.choice([1, 1, 2]),
            "mlp_only_layers": rng.sample(range(cfg["num_hidden_layers"]), k=rng.randint(0, 1)),
        })
    elif arch == "MixtralForCausalLM":
        cfg.update({"num_local_experts": rng.choice([2, 4, 8]), "num_experts_per_tok": 2})
    return cfg


def random_trainer_spec(rng: _random.Random, *, max_world: int = 8, inventory: Inventory | None = None) -> str:
    """``fsdp:N``, ``hsdp:RxS``, ``zero3:N`` or (with an inventory) ``megatron:tpT,ppP,...``."""
    kinds = ["fsdp", "hsdp", "zero3"] + (["megatron"] if inventory is not None else [])
    kind = rng.choice(kinds)
    if kind == "fsdp":
        return f"fsdp:{rng.randint(1, max_world)}"
    if kind == "zero3":
        return f"zero3:{rng.randint(1, max_world)}"
    if kind == "hsdp":
        r = rng.randint(2, max(2, max_world // 2))
        return f"hsdp:{r}x{rng.randint(1, max(1, max_world // r))}"
    assert inventory is not None
    cfg = inventory.config
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    tps = [t for t in TP_SIZES if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    tp = rng.choice(tps)
    pp = rng.randint(1, min(2, int(cfg["num_hidden_layers"])))
    dp = rng.randint(1, 2)
    eps = [e for e in (1, 2, 4) if (tp * dp) % e == 0 and _experts(cfg) % e == 0]
    return f"megatron:tp{tp},pp{pp},ep{rng.choice(eps)},dp{dp}"


def _experts(cfg: dict) -> int:
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 1


def random_engine_spec(rng: _random.Random, inventory: Inventory, *, fp8: bool | None = None) -> str:
    """A ``vllm:`` spec whose tensor parallel size fits the model's heads and dims."""
    from fastsync.layout.spec import engine_layout_from_spec

    cfg = inventory.config
    order = list(TP_SIZES)
    rng.shuffle(order)
    want_fp8 = rng.random() < 0.3 if fp8 is None else fp8
    for tp in order:
        dp = rng.choice([1, 1, 2])
        ep = _experts(cfg) > 1 and rng.random() < 0.5
        spec = f"vllm:tp{tp}" + (f",dp{dp}" if dp > 1 else "") + (",ep" if ep else "")
        spec += f",replicas{rng.randint(1, 2)}"
        for quant in ((",quant=fp8", "") if want_fp8 else ("",)):
            try:
                engine_layout_from_spec(spec + quant, inventory)
            except LayoutError:
                continue
            return spec + quant
    return "vllm:tp1"


def random_case(rng: _random.Random, **config_kw: Any) -> tuple[Inventory, str, str]:
    """(inventory, trainer spec, engine spec), all valid together."""
    cfg = random_config(rng, **config_kw)
    inv = inventory_from_config(cfg, name=f"random-{cfg['architectures'][0]}")
    return inv, random_trainer_spec(rng, inventory=inv), random_engine_spec(rng, inv)


def configs(**kw: Any) -> Any:
    """hypothesis strategy of config dicts (see :func:`random_config`)."""
    from hypothesis import strategies as st

    return st.randoms(use_true_random=False).map(lambda rng: random_config(rng, **kw))


def cases(**kw: Any) -> Any:
    """hypothesis strategy of (inventory, trainer spec, engine spec)."""
    from hypothesis import strategies as st

    return st.randoms(use_true_random=False).map(lambda rng: random_case(rng, **kw))
