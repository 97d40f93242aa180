"""Random real-architecture models: every drawn config matches the real transformers-v5 model and
every drawn (trainer spec, engine spec) builds a valid layout whose tensors rebuild from pieces."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from fastsync_rigs import random_layout as lrandom  # noqa: E402
from fastsync.layout.spec import engine_layout_from_spec, trainer_layout_from_spec  # noqa: E402
from fastsync.models import inventory_from_config  # noqa: E402

CONFIG_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "Qwen3ForCausalLM": "Qwen3Config",
                  "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "MixtralForCausalLM": "MixtralConfig",
                  "DeepseekV3ForCausalLM": "DeepseekV3Config"}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lrandom.configs())
def test_random_configs_match_transformers(cfg):
    arch = cfg["architectures"][0]
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    hf = getattr(transformers, CONFIG_CLASSES[arch])(**kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    inv = inventory_from_config(cfg)
    assert [(n, p.shape) for n, p in inv.params.items()] == [(n, tuple(t.shape)) for n, t in model.state_dict().items()]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lrandom.cases())
def test_random_cases_build_valid_layouts(case):
    inv, tspec, espec = case
    trainer = trainer_layout_from_spec(tspec, inv)
    engine = engine_layout_from_spec(espec, inv)
    trainer.validate()
    engine.validate(inv.params)


def test_fp8_friendly_configs_quantise():
    rng = random.Random(3)
    for _ in range(4):
        inv = inventory_from_config(lrandom.random_config(rng, fp8_friendly=True))
        spec = lrandom.random_engine_spec(rng, inv, fp8=True)
        assert "quant=fp8" in spec, (inv.config, spec)
