"""``model.external_lib=fastsync_verl.moe`` against verl 0.9.1's real FSDP engine: importing it
wraps ``FSDPEngine._build_module`` so the module verl builds has fastsync's MoE blocks, the same
logits and the same HF state-dict names and shapes (what verl exports for weight sync)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl + peft/datasets not installed "
                    "(see requirements/adapters.txt)")

_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_moe_job.py")


@pytest.mark.slow
def test_external_lib_swaps_moe_blocks_in_verls_fsdp_engine(tmp_path) -> None:
    out = subprocess.run([sys.executable, _JOB, str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["wrapped"] is True
    assert res["plain_blocks"] == []  # verl's own build, before the import, swaps nothing
    assert res["swapped_blocks"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert res["max_abs_diff"] <= 1e-5 * res["max_abs"]
    assert res["same_state_dict"] is True


def test_install_rejects_unknown_backend_and_uninstall_restores() -> None:
    import fastsync_verl.moe as moe
    from fastsync.errors import ConfigError
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    try:
        with pytest.raises(ConfigError, match="backend must be one of"):
            moe.install("cutlass")
        moe.uninstall()
        assert not getattr(FSDPEngine._build_module, "fastsync_wrapped", False) and moe.installed_backend() is None
        moe.install("torch")
        assert FSDPEngine._build_module.fastsync_wrapped and moe.installed_backend() == "torch"
    finally:
        moe.uninstall()
