"""CPU rigs and STAND-INs for the adapters' tests and CPU examples. Not in the wheel: what users
run (``fastsync bench|demo|gpu-check``, the verl backend, ``python -m
fastsync_openrlhf.train_ppo_ray``) reads nothing from here.

* ``verl_cpu``: verl's CPU gaps bridged (a CPU platform, the ``vllm`` distribution name, a
  tokenizer beside a tiny checkpoint);
* ``openrlhf_cpu``: OpenRLHF's sync path on a CPU host (Ray, the vLLM CPU engine, DeepSpeed ZeRO-3
  over gloo);
* ``standins/flash_attn``: the pure-torch padding helpers OpenRLHF imports at top level
  (``flash_attn`` does not install on CPU).

``tests/conftest.py`` puts :data:`PATH` on ``sys.path`` and ``PYTHONPATH`` (so Ray workers and
job processes find it too); the examples do the same for their own processes.
"""

from pathlib import Path

#: the folder holding this package (for ``sys.path`` / ``PYTHONPATH``)
PATH = str(Path(__file__).resolve().parent.parent)
#: the folder to put on ``PYTHONPATH`` for the ``flash_attn`` STAND-IN
STANDINS = str(Path(__file__).resolve().parent / "standins")
