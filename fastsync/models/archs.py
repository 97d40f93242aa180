"""Parameter enumerators: an HF ``config.json`` dict -> the transformers-v5 ``state_dict()`` names
and shapes of that architecture, in the model's own order.

Pure Python and fast (Kimi-K2's ~1,100 tensors take about a millisecond): no torch, no
transformers import. ``tests/models/test_inventory.py`` instantiates each architecture on the meta
device with the installed transformers and checks every name and shape against these.

transformers v5 fuses MoE experts into two 3-D parameters per layer:
``...mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` (per expert ``[gate; up]``) and
``...mlp.experts.down_proj`` ``[E, H, I]``.
"""

from __future__ import annotations

from collections.abc import Callable

from fastsync.errors import ConfigError
from fastsync.layout.limits import MAX_DIM, MAX_EXPERTS, MAX_LAYERS

__all__ = ["EXPERT_FORMAT_KEY", "expert_format", "ARCHITECTURES", "MODEL_TYPES", "enumerate_params", "cfg_get", "head_dim_of", "num_experts_of", "is_moe_layer", "mla_dims"]

Shape = tuple[int, ...]
Params = list[tuple[str, Shape]]

_MISSING = object()

#: Config key (fastsync's own, never in a published config.json) selecting the expert format.
EXPERT_FORMAT_KEY = "fastsync_expert_format"


def cfg_get(config: dict, key: str, default: object = _MISSING) -> object:
    """``config[key]``; ConfigError naming the key (and the architecture) when it is required
    and absent. A present ``None`` counts as absent when a default is given."""
    val = config.get(key, None)
    if val is None:
        if default is _MISSING:
            arch = (config.get("architectures") or ["?"])[0]
            raise ConfigError(f"config.json of {arch} lacks required key {key!r}")
        return default
    return val


#: Bounds of count-like keys (dimensions default to 1..MAX_DIM).
_BOUNDS = {
    "num_hidden_layers": (1, MAX_LAYERS),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "decoder_sparse_step": (0, MAX_LAYERS),
    "n_routed_experts": (1, MAX_EXPERTS),
    "num_experts": (1, MAX_EXPERTS),
    "num_local_experts": (1, MAX_EXPERTS),
    "n_shared_experts": (0, MAX_EXPERTS),
    "qk_nope_head_dim": (0, MAX_DIM),
}


def _int(config: dict, key: str, default: object = _MISSING) -> int:
    """``config[key]`` as an integer within its bound (``_BOUNDS``, else 1..MAX_DIM). A float
    such as ``1.5`` (or ``64.0``), a bool, NaN or a string is refused, never truncated."""
    val = cfg_get(config, key, default)
    lo, hi = _BOUNDS.get(key, (1, MAX_DIM))
    if val == 0 and default == 0 and key not in _BOUNDS:
        return 0  # an optional size whose absence reads as 0
    if not isinstance(val, int) or isinstance(val, bool):
        raise ConfigError(f"config key {key!r} must be an integer, got {val!r}")
    if not lo <= val <= hi:
        raise ConfigError(f"config key {key!r} = {val} is outside {lo}..{hi}")
    return val


def _check_heads(config: dict) -> None:
    heads = _int(config, "num_attention_heads")
    kv = _int(config, "num_key_value_heads", heads)
    if heads % kv:
        raise ConfigError(f"config keys num_attention_heads={heads} and num_key_value_heads={kv}: "
                          f"the query heads must be a multiple of the key/value heads")


def _check_moe(config: dict) -> int:
    """Routed experts, checked with ``num_experts_per_tok`` (1..experts) when given."""
    num_experts = num_experts_of(config)
    k = config.get("num_experts_per_tok")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts):
        raise ConfigError(f"config key 'num_experts_per_tok' must be an integer in 1..{num_experts} "
                          f"(the routed experts), got {k!r}")
    return num_experts


def num_experts_of(config: dict) -> int:
    """Routed experts per MoE layer: ``num_experts`` (Qwen3-MoE config.json), ``num_local_experts``
    (Mixtral, and what transformers v5 writes for Qwen3-MoE) or ``n_routed_experts`` (DeepSeek)."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if config.get(key) is not None:
            return _int(config, key)
    arch = (config.get("architectures") or ["?"])[0]
    raise ConfigError(f"config.json of {arch} lacks required key 'num_experts' (or num_local_experts/n_routed_experts)")


def head_dim_of(config: dict) -> int:
    """``head_dim`` when given, else ``hidden_size // num_attention_heads`` (HF's rule)."""
    if config.get("head_dim") is not None:
        return _int(config, "head_dim")
    hd = _int(config, "hidden_size") // _int(config, "num_attention_heads")
    if hd < 1:
        raise ConfigError(f"config keys hidden_size={config['hidden_size']} and num_attention_heads="
                          f"{config['num_attention_heads']} give head_dim 0; set head_dim")
    return hd


def _embed_and_head(config: dict, params: Params, body: Callable[[Params], None]) -> Params:
    vocab, hidden = _int(config, "vocab_size"), _int(config, "hidden_size")
    params.append(("model.embed_tokens.weight", (vocab, hidden)))
    body(params)
    params.append(("model.norm.weight", (hidden,)))
    # state_dict() lists lm_head.weight even when tied to the embedding (same storage).
    params.append(("lm_head.weight", (vocab, hidden)))
    return params


def _gqa_attention(config: dict, p: str, params: Params, *, qk_norm: bool) -> None:
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    kv = _int(config, "num_key_value_heads", heads)
    hd = head_dim_of(config)
    _check_heads(config)
    if heads * hd > MAX_DIM:
        raise ConfigError(f"config keys num_attention_heads*head_dim = {heads * hd} is over the limit {MAX_DIM}")
    bias = bool(config.get("attention_bias", False))
    params.append((f"{p}.self_attn.q_proj.weight", (heads * hd, hidden)))
    if bias:
        params.append((f"{p}.self_attn.q_proj.bias", (heads * hd,)))
    params.append((f"{p}.self_attn.k_proj.weight", (kv * hd, hidden)))
    if bias:
        params.append((f"{p}.self_attn.k_proj.bias", (kv * hd,)))
    params.append((f"{p}.self_attn.v_proj.weight", (kv * hd, hidden)))
    if bias:
        params.append((f"{p}.self_attn.v_proj.bias", (kv * hd,)))
    params.append((f"{p}.self_attn.o_proj.weight", (hidden, heads * hd)))
    if bias:
        params.append((f"{p}.self_attn.o_proj.bias", (hidden,)))
    if qk_norm:
        params.append((f"{p}.self_attn.q_norm.weight", (hd,)))
        params.append((f"{p}.self_attn.k_norm.weight", (hd,)))


def _dense_mlp(p: str, hidden: int, inter: int, params: Params) -> None:
    params.append((f"{p}.gate_proj.weight", (inter, hidden)))
    params.append((f"{p}.up_proj.weight", (inter, hidden)))
    params.append((f"{p}.down_proj.weight", (hidden, inter)))


def expert_format(config: dict) -> str:
    """``"fused"`` (transformers v5: ``experts.gate_up_proj`` / ``experts.down_proj``) or
    ``"per_expert"`` (one ``nn.Linear`` per expert: ``experts.{e}.gate_proj.weight``, ``up_proj``,
    ``down_proj``, as transformers 4.x and many training frameworks hold them), read from the
    config key :data:`EXPERT_FORMAT_KEY` that ``inventory_from_config(fused_experts=False)`` sets."""
    fmt = config.get(EXPERT_FORMAT_KEY, "fused")
    if fmt not in ("fused", "per_expert"):
        raise ConfigError(f"config key {EXPERT_FORMAT_KEY!r} must be 'fused' or 'per_expert', got {fmt!r}")
    return fmt


#: Per-expert tensors a model may list (experts x MoE layers x 3); beyond it use the fused format.
MAX_PER_EXPERT_TENSORS = 1 << 20


def _experts(p: str, num_experts: int, hidden: int, inter: int, params: Params, fmt: str = "fused") -> None:
    if fmt == "per_expert":
        for e in range(num_experts):
            params.append((f"{p}.experts.{e}.gate_proj.weight", (inter, hidden)))
            params.append((f"{p}.experts.{e}.up_proj.weight", (inter, hidden)))
            params.append((f"{p}.experts.{e}.down_proj.weight", (hidden, inter)))
        return
    params.append((f"{p}.experts.gate_up_proj", (num_experts, 2 * inter, hidden)))
    params.append((f"{p}.experts.down_proj", (num_experts, hidden, inter)))


def _check_per_expert(config: dict, num_experts: int, layers: int) -> None:
    if expert_format(config) == "per_expert" and 3 * num_experts * layers > MAX_PER_EXPERT_TENSORS:
        raise ConfigError(f"per-expert format: {num_experts} experts x {layers} layers is {3 * num_experts * layers} "
                          f"tensors, over the limit {MAX_PER_EXPERT_TENSORS}; use the fused expert format")


def _norms(p: str, hidden: int, params: Params) -> None:
    params.append((f"{p}.input_layernorm.weight", (hidden,)))
    params.append((f"{p}.post_attention_layernorm.weight", (hidden,)))


def _reject_mlp_bias(config: dict) -> None:
    if config.get("mlp_bias"):
        raise ConfigError("config key 'mlp_bias' = true is not supported (no built-in name map for MLP biases)")


def llama_params(config: dict) -> Params:
    """LlamaForCausalLM and Qwen3ForCausalLM (``qk_norm`` for Qwen3)."""
    return _decoder_dense(config, qk_norm=False)


def qwen3_params(config: dict) -> Params:
    return _decoder_dense(config, qk_norm=True)


def _decoder_dense(config: dict, *, qk_norm: bool) -> Params:
    _reject_mlp_bias(config)
    hidden, inter, layers = (_int(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))

    def body(params: Params) -> None:
        for i in range(layers):
            p = f"model.layers.{i}"
            _gqa_attention(config, p, params, qk_norm=qk_norm)
            _dense_mlp(f"{p}.mlp", hidden, inter, params)
            _norms(p, hidden, params)

    return _embed_and_head(config, [], body)


def is_moe_layer(architecture: str, config: dict, layer: int) -> bool:
    """Whether decoder layer ``layer`` holds routed experts (each architecture's own rule,
    identical in transformers v5 and vLLM 0.32)."""
    if architecture == "Qwen3MoeForCausalLM":
        sparse_step = _int(config, "decoder_sparse_step", 1)
        only_mlp = config.get("mlp_only_layers") or []
        if not isinstance(only_mlp, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in only_mlp):
            raise ConfigError(f"config key 'mlp_only_layers' must be a list of layer indices, got {only_mlp!r}")
        return (
            layer not in only_mlp
            and num_experts_of(config) > 0
            and sparse_step > 0
            and (layer + 1) % sparse_step == 0
        )
    if architecture == "DeepseekV3ForCausalLM":
        return layer >= _int(config, "first_k_dense_replace", 0) and num_experts_of(config) > 0
    if architecture == "MixtralForCausalLM":
        return True
    return False


def qwen3_moe_params(config: dict) -> Params:
    _reject_mlp_bias(config)
    arch = "Qwen3MoeForCausalLM"
    hidden, layers = _int(config, "hidden_size"), _int(config, "num_hidden_layers")
    num_experts = _check_moe(config)
    _check_per_expert(config, num_experts, layers)
    moe_inter = _int(config, "moe_intermediate_size")
    inter = _int(config, "intermediate_size", 0)
    if config.get("shared_expert_intermediate_size"):
        raise ConfigError("Qwen3MoeForCausalLM with shared_expert_intermediate_size is Qwen2-MoE style: not supported")

    def body(params: Params) -> None:
        for i in range(layers):
            p = f"model.layers.{i}"
            _gqa_attention(config, p, params, qk_norm=True)
            if is_moe_layer(arch, config, i):
                _experts(f"{p}.mlp", num_experts, hidden, moe_inter, params, expert_format(config))
                params.append((f"{p}.mlp.gate.weight", (num_experts, hidden)))
            else:
                if not inter:
                    raise ConfigError(f"Qwen3MoeForCausalLM layer {i} is dense but intermediate_size is missing")
                _dense_mlp(f"{p}.mlp", hidden, inter, params)
            _norms(p, hidden, params)

    return _embed_and_head(config, [], body)


def mixtral_params(config: dict) -> Params:
    hidden, inter, layers = (_int(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    num_experts = _check_moe(config)
    _check_per_expert(config, num_experts, layers)

    def body(params: Params) -> None:
        for i in range(layers):
            p = f"model.layers.{i}"
            _gqa_attention(config, p, params, qk_norm=False)
            params.append((f"{p}.mlp.gate.weight", (num_experts, hidden)))
            _experts(f"{p}.mlp", num_experts, hidden, inter, params, expert_format(config))
            _norms(p, hidden, params)

    return _embed_and_head(config, [], body)


def mla_dims(config: dict) -> dict[str, int | None]:
    """DeepSeek MLA dimensions (q_lora_rank may be None: then q is one projection)."""
    q_lora = config.get("q_lora_rank")
    return {
        "heads": _int(config, "num_attention_heads"),
        "q_lora_rank": None if q_lora is None else _int(config, "q_lora_rank"),
        "kv_lora_rank": _int(config, "kv_lora_rank"),
        "qk_nope_head_dim": _int(config, "qk_nope_head_dim"),
        "qk_rope_head_dim": _int(config, "qk_rope_head_dim"),
        "v_head_dim": _int(config, "v_head_dim"),
    }


def deepseek_v3_params(config: dict) -> Params:
    arch = "DeepseekV3ForCausalLM"
    hidden, inter, layers = (_int(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    d = mla_dims(config)
    heads, q_lora, kv_lora = d["heads"], d["q_lora_rank"], d["kv_lora_rank"]
    qk_head = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    num_experts = _check_moe(config)
    _check_per_expert(config, num_experts, layers)
    moe_inter = _int(config, "moe_intermediate_size")
    num_shared = _int(config, "n_shared_experts", 0)

    def body(params: Params) -> None:
        for i in range(layers):
            p = f"model.layers.{i}.self_attn"
            if q_lora is None:
                params.append((f"{p}.q_proj.weight", (heads * qk_head, hidden)))
            else:
                params.append((f"{p}.q_a_proj.weight", (q_lora, hidden)))
                params.append((f"{p}.q_a_layernorm.weight", (q_lora,)))
                params.append((f"{p}.q_b_proj.weight", (heads * qk_head, q_lora)))
            params.append((f"{p}.kv_a_proj_with_mqa.weight", (kv_lora + d["qk_rope_head_dim"], hidden)))
            params.append((f"{p}.kv_a_layernorm.weight", (kv_lora,)))
            params.append((f"{p}.kv_b_proj.weight", (heads * (d["qk_nope_head_dim"] + d["v_head_dim"]), kv_lora)))
            params.append((f"{p}.o_proj.weight", (hidden, heads * d["v_head_dim"])))
            m = f"model.layers.{i}.mlp"
            if is_moe_layer(arch, config, i):
                _experts(m, num_experts, hidden, moe_inter, params, expert_format(config))
                params.append((f"{m}.gate.weight", (num_experts, hidden)))
                params.append((f"{m}.gate.e_score_correction_bias", (num_experts,)))
                # transformers builds shared_experts unconditionally (zero-sized when n_shared_experts=0)
                _dense_mlp(f"{m}.shared_experts", hidden, moe_inter * num_shared, params)
            else:
                _dense_mlp(m, hidden, inter, params)
            _norms(f"model.layers.{i}", hidden, params)

    return _embed_and_head(config, [], body)


#: The built-in architectures (config.json ``architectures[0]``) -> parameter enumerator. They are
#: registered through the ``fastsync_register_architectures`` hook (``fastsync._builtin.models``)
#: like a plugin's; code that needs the full set asks ``fastsync.plugins.architectures()``.
ARCHITECTURES: dict[str, Callable[[dict], Params]] = {
    "LlamaForCausalLM": llama_params,
    "Qwen3ForCausalLM": qwen3_params,
    "Qwen3MoeForCausalLM": qwen3_moe_params,
    "MixtralForCausalLM": mixtral_params,
    "DeepseekV3ForCausalLM": deepseek_v3_params,
}


#: ``model_type`` -> built-in architecture, for configs without an ``architectures`` entry.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}


def enumerate_params(architecture: str, config: dict) -> Params:
    """The parameters of ``architecture`` (any registered one) for ``config``."""
    from fastsync import plugins

    regs = plugins.architectures()
    if architecture not in regs:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: {sorted(regs)}")
    return regs[architecture].obj(config)
