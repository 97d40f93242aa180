"""The GPU check's plumbing that needs no GPU: parts under hard deadlines, the JSON report, the
carried-wheel list and the entry-point metadata that stands in for ``pip install -e .``.

Everything here runs (and is tested) on CPU machines; ``check.py`` puts it together.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastsync.errors import ConfigError

__all__ = [
    "SCHEMA", "PART_STATUSES", "EXIT_CODES", "run_part", "assemble", "verdict", "summary_lines", "read_wheel_list",
    "installed_dists", "write_entry_points", "cuda_info",
]

SCHEMA = "fastsync-gpu-check/1"
PART_STATUSES = ("ok", "failed", "timeout", "skipped")


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the part's whole process group (it spawns workers), SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; its children may not be: one more sweep of the group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def run_part(name: str, argv: Sequence[str], timeout_s: float, result_path: Path, log_path: Path,
             env: dict[str, str] | None = None, cwd: str | None = None) -> dict[str, Any]:
    """Run one part as its own process group with a hard deadline.

    The part writes its JSON result to ``result_path`` (a dict with at least ``ok``); its output
    is appended to ``log_path``. Returns ``{status, seconds, exit_code, error, result}``: status
    ``ok`` only when the process exited 0 and its result says ``ok``; ``skipped`` when it exited 0
    and its result says ``"status": "skipped"`` (nothing of it ran here; ``error`` carries its
    ``reason``); ``timeout`` when the deadline killed it (with whatever it had written by then);
    ``failed`` otherwise.
    """
    if timeout_s <= 0:
        raise ConfigError(f"part {name!r}: timeout_s must be positive, got {timeout_s}")
    result_path = Path(result_path)
    result_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"\n=== part {name}: {' '.join(argv)} (deadline {timeout_s:.0f} s)\n".encode())
        log.flush()
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)  # also reaps workers a finished part left behind
    seconds = time.monotonic() - t0
    result: dict[str, Any] | None = None
    error: str | None = None
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except ValueError as e:
            error = f"part {name!r} wrote an unreadable result ({e})"
    if timed_out:
        status, error = "timeout", f"part {name!r} killed at its {timeout_s:.0f} s deadline"
    elif proc.returncode != 0:
        status = "failed"
        error = error or (result or {}).get("error") or f"part {name!r} exited with {proc.returncode} (see the log)"
    elif result is None:
        status, error = "failed", error or f"part {name!r} exited 0 without writing {result_path.name}"
    elif not result.get("ok"):
        status, error = "failed", result.get("error") or f"part {name!r} reported not ok"
    elif result.get("status") == "skipped":
        status, error = "skipped", result.get("reason") or f"part {name!r} skipped (it gave no reason)"
    else:
        status = "ok"
    return {"status": status, "seconds": round(seconds, 2), "exit_code": proc.returncode,
            "error": error, "result": result}


def assemble(*, parts: dict[str, dict[str, Any]], env: dict[str, Any], wheels: list[dict[str, str]],
             dry_run: bool, started: str, wall_s: float, error: str | None = None) -> dict[str, Any]:
    """The one JSON object of a check. ``ok`` is true when nothing failed: no error stopped the
    check and no part failed or timed out. It is not a claim that everything was checked: a skip
    is not a pass, so ``verdict`` says ``passed`` only when every part ran and passed and no GPU
    test was skipped, ``passed_with_skips`` when nothing failed but something was skipped (listed
    in ``summary``), ``failed``, or ``not_run`` (dry run, or the check could not start).
    ``error`` is the check's own error, else the first failing part's."""
    for n, p in parts.items():
        if p.get("status") not in PART_STATUSES:
            raise ConfigError(f"part {n!r}: status {p.get('status')!r} not one of {PART_STATUSES}")
    bad = [n for n, p in parts.items() if p["status"] in ("failed", "timeout")]
    if error is None and bad:
        error = f"part {bad[0]!r} {parts[bad[0]]['status']}: {parts[bad[0]].get('error')}"
    summary = _summary(parts)
    return {
        "schema": SCHEMA,
        "ok": error is None and not bad,
        "verdict": verdict(summary, error=error, dry_run=dry_run),
        "error": error,
        "dry_run": dry_run,
        "started": started,
        "wall_s": round(wall_s, 2),
        "env": env,
        "wheels": wheels,
        "parts": parts,
        "summary": summary,
    }


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def verdict(summary: dict[str, Any], *, error: str | None, dry_run: bool) -> str:
    """``passed`` | ``passed_with_skips`` | ``failed`` | ``not_run`` (see ``assemble``)."""
    counts = summary["parts"]
    tests = summary.get("gpu_tests") or {}
    if counts["failed"] or tests.get("failed") or tests.get("errors"):
        return "failed"
    if dry_run or (error is not None and not any(counts.values())):
        return "not_run"
    if error is not None:
        return "failed"
    if not counts["passed"]:
        return "not_run"
    if counts["skipped"] or tests.get("skipped"):
        return "passed_with_skips"
    return "passed"


#: exit status of ``python -m fastsync.gpu.check`` (and scripts/gpu_check.sh) per verdict
EXIT_CODES = {"passed": 0, "failed": 1, "not_run": 2, "passed_with_skips": 3}


def summary_lines(rep: dict[str, Any]) -> list[str]:
    """The check's closing words, for a person: parts and tests passed / skipped / failed, each
    count on its own, what was skipped and why, and the verdict (never "ok" for a skip)."""
    s = rep["summary"]
    c = s["parts"]
    lines = [f"parts: {c['passed']} passed, {c['skipped']} skipped, {c['failed']} failed"
             + "".join(f"; {n} {st}" for st in ("skipped", "failed") for n in s["part_names"][st])]
    for n in s["part_names"]["skipped"]:
        lines.append(f"  part {n} skipped: {rep['parts'][n].get('error')}")
    t = s.get("gpu_tests")
    if t is not None:
        lines.append(f"gpu tests: {t['passed']} passed, {t['skipped']} skipped, {t['failed']} failed, "
                     f"{t['errors']} errors")
        for case in t.get("skipped_tests", []):
            lines.append(f"  skipped {case['name']}: {case['reason']}")
    v = rep["verdict"]
    lines.append({
        "passed": "verdict: passed (every part ran and passed, no test skipped)",
        "passed_with_skips": "verdict: PASSED WITH SKIPS: nothing failed, but what was skipped above was not "
                             "checked on this machine (exit 3)",
        "failed": f"verdict: FAILED ({rep.get('error')})",
        "not_run": f"verdict: not run ({rep.get('error') or 'dry run: no part ran'})",
    }[v])
    return lines


def _summary(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts of parts passed / skipped / failed (a timeout is a failure) and the headline
    figures, lifted from the parts' results (None where a part did not give them)."""
    sync = _get(parts, "sync", "result")
    moe = _get(parts, "moe", "result")
    tests = _get(parts, "gpu_tests", "result")
    names = {"passed": [n for n, p in parts.items() if p["status"] == "ok"],
             "skipped": [n for n, p in parts.items() if p["status"] == "skipped"],
             "failed": [n for n, p in parts.items() if p["status"] in ("failed", "timeout")]}
    gpu_tests = None
    if isinstance(tests, dict):
        gpu_tests = {k: int(tests.get(k) or 0) for k in ("passed", "skipped", "failed", "errors")}
        gpu_tests["skipped_tests"] = [{"name": c.get("name"), "reason": c.get("message")}
                                      for c in tests.get("cases", []) if c.get("outcome") == "skipped"]
    return {
        "parts": {k: len(v) for k, v in names.items()},
        "part_names": names,
        "nixl_gbps": _get(sync, "bf16", "nixl", "gbps"),
        "rank0_gbps": _get(sync, "bf16", "rank0", "gbps") or _get(sync, "bf16_rank0_only", "rank0", "gbps"),
        "nixl_vs_rank0": _get(sync, "bf16", "nixl_vs_rank0"),
        "device_copy_gbps": _get(sync, "device_copy", "gbps"),
        "nixl_fraction_of_device_copy": _get(sync, "bf16", "nixl_fraction_of_device_copy"),
        "nixl_fp8_gbps": _get(sync, "fp8", "nixl", "gbps"),
        "moe_fastsync_vs_hf_grouped_mm": _get(moe, "speedup_vs_hf_grouped_mm"),
        "moe_fastsync_vs_hf_eager": _get(moe, "speedup_vs_hf_eager"),
        "moe_peak_mem_vs_hf_grouped_mm": _get(moe, "peak_mem_ratio_vs_hf_grouped_mm"),
        "gpu_tests": gpu_tests,
    }


def read_wheel_list(path: Path) -> list[tuple[str, str]]:
    """``name==version`` lines of ``scripts/gpu_wheels.txt`` (comments and blanks ignored);
    ConfigError naming the line when one is not pinned exactly."""
    out: list[tuple[str, str]] = []
    for i, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip() or any(c in version for c in "<>=!~,* "):
            raise ConfigError(f"{path}:{i}: {raw.strip()!r} is not pinned as name==version")
        out.append((name.strip(), version.strip()))
    return out


def installed_dists(site_dir: Path) -> list[dict[str, str]]:
    """``[{name, version}]`` of the distributions installed in ``site_dir`` (its dist-infos)."""
    import importlib.metadata as md

    rows = [{"name": d.metadata["Name"], "version": d.version} for d in md.distributions(path=[str(site_dir)])]
    return sorted(rows, key=lambda r: r["name"].lower())


def write_entry_points(pyproject: Path, site_dir: Path, group: str = "fastsync") -> Path:
    """Write a metadata-only dist-info for fastsync into ``site_dir``, carrying ``group``'s entry
    points from ``pyproject.toml``: fastsync finds its built-in plugins through entry points, and
    on the GPU machine the package runs from the source tree (PYTHONPATH), not from an install."""
    proj = tomllib.loads(Path(pyproject).read_text())["project"]
    eps = proj.get("entry-points", {}).get(group)
    if not eps:
        raise ConfigError(f"{pyproject}: no [project.entry-points.{group}] table")
    dist = Path(site_dir) / f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n")
    lines = [f"[{group}]"] + [f"{k} = {v}" for k, v in eps.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dist


def cuda_info() -> tuple[dict[str, Any], str | None]:
    """What this process sees: versions and the device, and an error when there is no CUDA device."""
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError as e:
        info["transformers"] = f"not importable: {e}"
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
        return info, f"no CUDA device: {why} (torch {torch.__version__}); the GPU check needs one"
    props = torch.cuda.get_device_properties(0)
    info.update(device_count=torch.cuda.device_count(), device=props.name,
                device_mem_bytes=props.total_memory, capability=f"{props.major}.{props.minor}")
    return info, None
