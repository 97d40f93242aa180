"""What this CPU can run: vLLM-CPU's block-FP8 kernels need Intel AMX (``amx_tile``).

Tests that build FP8 models in a real vLLM CPU worker skip with :func:`fp8_skip_reason` where the
kernel is absent (AMD EPYC, older Xeons) instead of failing. ``FASTSYNC_ASSUME_NO_AMX=1`` makes
:func:`cpu_has_amx` answer False on an AMX machine, so the skip path can be exercised (and the
rest of such a module shown to run) where AMX is present.
"""

from __future__ import annotations

import os

from fastsync.engines.vllm.mla import ASSUME_NO_AMX_ENV  # one name for the switch, product and tests

__all__ = ["cpu_flags", "cpu_has_amx", "fp8_skip_reason"]

def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The ``flags`` of the first processor in ``cpuinfo`` (empty when unreadable)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU reports AMX tiles (``amx_tile`` in /proc/cpuinfo), unless
    ``FASTSYNC_ASSUME_NO_AMX=1`` says to act as if it did not."""
    if os.environ.get(ASSUME_NO_AMX_ENV, "") not in ("", "0"):
        return False
    return "amx_tile" in cpu_flags(cpuinfo)


def fp8_skip_reason(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """None when vLLM-CPU's block-FP8 kernels can run here, else why not (for ``pytest.skip``)."""
    if cpu_has_amx(cpuinfo):
        return None
    forced = os.environ.get(ASSUME_NO_AMX_ENV, "") not in ("", "0")
    why = f"{ASSUME_NO_AMX_ENV}=1" if forced else "no 'amx_tile' in /proc/cpuinfo flags"
    return f"vLLM-CPU block-FP8 kernels need Intel AMX ({why})"
