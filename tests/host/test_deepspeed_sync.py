"""``fastsync.DeepSpeedWeightSync``'s refusals, before any byte moves, in a one-rank gloo job of its own:
no torch.distributed group, no engines, a ZeRO stage out of range, a parameter whose ZeRO-3 partition
disagrees with ``zero_stage`` (named), a PEFT policy whose merge is not ``W + s * B @ A`` (DoRA, named). Its syncs through real DeepSpeed and vLLM run in
tests/matrix/test_matrix_openrlhf.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

JOB = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from fastsync import ConfigError, DeepSpeedWeightSync, LayoutError
    m = torch.nn.Linear(7, 5)
    def refused(**kw):
        try:
            DeepSpeedWeightSync(m, **{"engines": [object()], "zero_stage": 3, **kw})
        except ConfigError as e:
            print("CONFIG", e)
    refused()  # before the group exists
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    refused(engines=[])
    refused(zero_stage=4)
    import peft  # a PEFT policy goes merged: a DoRA one is refused by its setting's name, at construction
    dora = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(7, 5)), peft.LoraConfig(r=2, target_modules=["0"],
                                                                                         use_dora=True))
    try:
        DeepSpeedWeightSync(dora, engines=[object()], zero_stage=2, control_host="127.0.0.1")
    except ConfigError as e:
        print("CONFIG", e)
    m.weight.ds_tensor, m.weight.ds_numel, m.weight.ds_shape = torch.zeros(35), 35, m.weight.shape  # bias is not
    for stage in (3, 2):
        try:
            DeepSpeedWeightSync(m, engines=[object()], zero_stage=stage, control_host="127.0.0.1").setup()
        except LayoutError as e:
            print("REFUSED", stage, e)
    dist.destroy_process_group()
""")


def test_refusals_name_what_is_wrong_before_anything_starts(free_port) -> None:
    out = subprocess.run([sys.executable, "-c", JOB, str(free_port())], capture_output=True, text=True, timeout=120)
    config = [ln for ln in out.stdout.splitlines() if ln.startswith("CONFIG")]
    assert len(config) == 4, out.stdout + out.stderr[-2000:]
    assert "needs DeepSpeed's torch.distributed group" in config[0]
    assert "no engines to sync into" in config[1] and "zero_stage must be 0-3, got 4" in config[2]
    assert "LoraConfig.use_dora=True" in config[3]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(lines) == 2, out.stdout + out.stderr[-2000:]
    assert "'bias' is not a ZeRO-3 partition, but zero_stage is 3" in lines[0]
    assert "'weight' is a ZeRO-3 partition, but zero_stage is 2" in lines[1]
