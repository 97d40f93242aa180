"""The AMX detection that decides whether FP8 vLLM cases run or skip."""

from __future__ import annotations

from fastsync_rigs.cpu import ASSUME_NO_AMX_ENV, cpu_flags, cpu_has_amx, fp8_skip_reason

XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"


def test_amx_read_from_cpuinfo_flags(tmp_path, monkeypatch):
    monkeypatch.delenv(ASSUME_NO_AMX_ENV, raising=False)
    xeon, epyc = tmp_path / "xeon", tmp_path / "epyc"
    xeon.write_text(XEON)
    epyc.write_text(EPYC)
    assert "amx_tile" in cpu_flags(str(xeon))
    assert cpu_has_amx(str(xeon)) and fp8_skip_reason(str(xeon)) is None
    assert not cpu_has_amx(str(epyc))
    assert "no 'amx_tile'" in fp8_skip_reason(str(epyc))
    assert not cpu_has_amx(str(tmp_path / "missing"))  # unreadable: act as absent


def test_env_override_forces_amx_absent(tmp_path, monkeypatch):
    xeon = tmp_path / "xeon"
    xeon.write_text(XEON)
    monkeypatch.setenv(ASSUME_NO_AMX_ENV, "1")
    assert not cpu_has_amx(str(xeon))
    assert ASSUME_NO_AMX_ENV in fp8_skip_reason(str(xeon))
    monkeypatch.setenv(ASSUME_NO_AMX_ENV, "0")
    assert cpu_has_amx(str(xeon))
