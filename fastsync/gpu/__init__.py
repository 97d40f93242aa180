"""The GPU check: every GPU figure in one prepared call, for a machine lent for minutes.

``scripts/gpu_check.sh OUTDIR`` installs the wheels carried in ``gpu_wheels/`` (``make gpu-wheels``
on a machine with PyPI) into a private folder and runs ``python -m fastsync.gpu.check OUTDIR``,
which runs each part in its own process group under a hard deadline and writes
``OUTDIR/gpu_check.json`` (``report.py``). Parts: NIXL VRAM->VRAM sync vs the rank-0 path vs a
device copy (``sync_check.py``), the bf16 MoE swap at Qwen3-30B-A3B shapes (``moe_check.py``),
and the ``gpu``-marked tests. Nothing here is imported by the library.
"""
