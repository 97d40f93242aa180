"""STAND-INS for what does not install on a CPU host, for the CPU rig and benchmark only.

``flash_attn/`` holds only the pure-torch padding helpers OpenRLHF imports at top level
(``flash_attn`` itself needs CUDA to build). Nothing puts this folder on ``sys.path`` unless the
real ``flash_attn`` is missing and a CPU rig asks for it (:data:`PATH`, used by
``fastsync_openrlhf.cpu_rig`` / ``bench``, the CPU smoke example and the tests); it ships in the
wheel so the benchmark runs without the source tree.
"""

from pathlib import Path

#: the folder to put on ``PYTHONPATH`` (it contains the ``flash_attn`` stand-in package)
PATH = str(Path(__file__).resolve().parent)
