"""fastsync for OpenRLHF, without a fork.

* ``python -m fastsync_openrlhf.train_ppo_ray`` takes OpenRLHF's own ``train_ppo_ray`` arguments
  plus ``--fastsync.*``; it rebinds OpenRLHF's ``RolloutRayActor`` and ``PolicyModelActor`` to
  subclasses (``hooks.py``) and runs ``openrlhf.cli.train_ppo_ray`` as ``__main__``.
* Rollout side (``rollout.py``, ``rollout_worker.py``): OpenRLHF's ``WorkerWrap`` and fastsync's
  vLLM worker extension in one ``worker_extension_cls``. No DeepSpeed import there.
* Trainer side (``trainer.py``): ``fastsync.DeepSpeedWeightSync`` plans from DeepSpeed ZeRO-3's own
  partitions (``zero3:N``) and every rank writes its partitions into the engines (NIXL).

Importing this package imports nothing heavy.
"""

from __future__ import annotations

SUPPORTED_OPENRLHF = ("0.11.2",)

__all__ = ["SUPPORTED_OPENRLHF"]
