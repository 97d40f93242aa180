"""Which MLA backend an engine fastsync starts runs on, and the refusal that names AMX_MLA's rules
(``fastsync.engines.vllm.mla``), on CPU, no engine. Both CPU kinds' answers are checked on either
machine: ``amx=`` and the ``FASTSYNC_ASSUME_*`` variables stand in for the detection."""

from __future__ import annotations

import os
import sys

import pytest

from fastsync.engines.vllm.mla import (
    ASSUME_AMX_ENV,
    ASSUME_NO_AMX_ENV,
    amx_mla_needs,
    attention_config,
    host_has_amx,
)
from fastsync.errors import ConfigError

sys.path.insert(0, os.path.dirname(__file__))

#: the shapes issue 36 saw AMX_MLA refuse at engine start ("invalid weight out features 40")
OLD_HAND = dict(kv_lora_rank=40, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
OLD_E2E = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=40, v_head_dim=36)
LLAMA = dict(hidden_size=200, num_attention_heads=4)


def test_amx_mla_needs_names_each_rule_the_model_breaks():
    hand = amx_mla_needs(OLD_HAND, "bfloat16")
    assert any("576 (this model: 40 + 32 = 72)" in n for n in hand)
    assert any("kv_lora_rank a multiple of 32" in n and "40" in n for n in hand)
    assert not any("v_head_dim" in n or "qk_nope" in n for n in hand)
    e2e = amx_mla_needs(OLD_E2E, "float32")
    assert any("dtype bfloat16 (the engine's is float32)" in n for n in e2e)
    assert any("qk_nope_head_dim a multiple of 32" in n and "40" in n for n in e2e)
    assert any("v_head_dim a multiple of 16" in n and "36" in n for n in e2e)
    assert not any("576" in n for n in e2e)


def test_the_suites_deepseek_models_fit_every_cpu_mla_backend():
    pytest.importorskip("transformers")
    from test_vllm_recorded import DEEPSEEK_E2E, HAND

    for cfg in (HAND["deepseek-v3"][2], DEEPSEEK_E2E[2]):
        assert amx_mla_needs(cfg, "bfloat16") == []
        assert cfg["hidden_size"] % 64 and cfg["q_lora_rank"] % 64  # still awkward elsewhere


def test_engines_fastsync_starts_ask_for_cpu_mla_where_vllm_would_pick_amx():
    mla = dict(OLD_E2E)
    assert attention_config(mla, "float32", amx=True) == {"backend": "CPU_MLA"}
    assert attention_config(mla, "float32", amx=False) is None  # vLLM picks CPU_MLA itself
    assert attention_config(LLAMA, "bfloat16", amx=True) is None  # not MLA: left alone
    assert attention_config(mla, "bfloat16", requested="cpu_mla", amx=False) == {"backend": "CPU_MLA"}


def test_asking_for_amx_mla_is_refused_naming_why_and_the_models_sizes():
    with pytest.raises(ConfigError, match="AMX_MLA.*packed copies.*kv_lora_rank a multiple of 32.*this model: 40.*CPU_MLA"):
        attention_config(OLD_HAND, "bfloat16", requested="AMX_MLA", amx=True)
    fits = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    with pytest.raises(ConfigError, match="does not re-derive") as e:
        attention_config(fits, "bfloat16", requested="AMX_MLA")
    assert "besides" not in str(e.value)  # a model that fits hears only fastsync's own reason


def test_detection_overrides(monkeypatch):
    monkeypatch.setenv(ASSUME_AMX_ENV, "1")
    assert host_has_amx()
    assert attention_config(OLD_E2E, "float32") == {"backend": "CPU_MLA"}
    monkeypatch.setenv(ASSUME_NO_AMX_ENV, "1")  # "no" wins: the test rigs' switch for FP8 skips too
    assert not host_has_amx()
    assert attention_config(OLD_E2E, "float32") is None


def test_the_rules_are_the_installed_vllms():
    """The constants fastsync checks against are vLLM-CPU's own: AMX_MLA's head size and dtype."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    from fastsync.engines.vllm.mla import AMX_MLA_HEAD_SIZE

    assert AMXMLABackend.get_supported_head_sizes() == [AMX_MLA_HEAD_SIZE]
    assert list(AMXMLABackend.supported_dtypes) == [torch.bfloat16]
