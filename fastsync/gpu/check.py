"""``python -m fastsync.gpu.check OUTDIR``: run the GPU check's parts and write ``OUTDIR/gpu_check.json``.

Started by ``scripts/gpu_check.sh`` after it installed the carried wheels. Order: look for a CUDA
device (none: write the JSON with that error and exit 2, which is all a dry run on a CPU
machine can do), then each part in its own process group under a hard deadline (``PARTS``;
together well inside the 8 minutes the check is allowed), the JSON rewritten after each part
so a check killed from outside still leaves the parts it finished. Exit 0 when every part ran
and passed with no test skipped, 3 when nothing failed but a part or a test was skipped (a skip
is not a pass: the closing lines list what and why), 1 when something failed or timed out, 2 when
the check could not run at all (a dry run exits 0 after saying that no part ran).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fastsync.gpu.report import EXIT_CODES, assemble, cuda_info, installed_dists, run_part, summary_lines

__all__ = ["PARTS", "QUICK", "gpu_test_files", "main"]

#: part -> (module run with ``-m``, its arguments, deadline in seconds); 400 s in all
PARTS: dict[str, tuple[str, list[str], float]] = {
    "sync": ("fastsync.gpu.sync_check", ["--size-gb", "4", "--fp8-size-gb", "1", "--steps", "3"], 190.0),
    "moe": ("fastsync.gpu.moe_check", ["--tokens", "8192", "--reps", "10"], 130.0),
    "gpu_tests": ("fastsync.gpu.check", ["--run-gpu-tests"], 80.0),
}
#: ``--quick`` (GPU_CHECK_QUICK=1): smaller runs, shorter deadlines (230 s in all), for a retry
#: with little device time left
QUICK: dict[str, tuple[list[str], float]] = {
    "sync": (["--size-gb", "1", "--fp8-size-gb", "0.25", "--steps", "2"], 100.0),
    "moe": (["--tokens", "4096", "--reps", "5", "--fp32-tokens", "512"], 70.0),
    "gpu_tests": (["--run-gpu-tests"], 60.0),
}
#: ``--cpu-rehearsal``: every part's code on the CPU at toy sizes (the tests run it), so the
#: orchestration, the parts and the report are proven before a GPU machine's minutes are spent
CPU_REHEARSAL: dict[str, tuple[list[str], float]] = {
    "sync": (["--device", "cpu", "--size-gb", "0.05", "--fp8-size-gb", "0.05", "--trainers", "2", "--rollouts", "2",
              "--steps", "2"], 300.0),
    "moe": (["--device", "cpu", "--preset", "tiny-qwen3-moe", "--dtype", "float32", "--tokens", "64", "--reps", "2",
             "--fp32-tokens", "32"], 120.0),
    "gpu_tests": (["--run-gpu-tests"], 120.0),
}
GPU_MARK = "pytest.mark.gpu"


class _Terminated(Exception):
    pass


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated(f"stopped by signal {signum} (the outer deadline) while this part ran")


def gpu_test_files(root: Path) -> list[str]:
    """Test files that carry the ``gpu`` mark (collecting the whole suite would import vLLM, Ray
    and verl, which the GPU machine does not have)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py") if GPU_MARK in p.read_text())


def _run_gpu_tests(out: Path, root: Path) -> int:
    """Part ``gpu_tests``: ``pytest -m gpu`` over the marked files; counts and outcomes from JUnit XML."""
    import xml.etree.ElementTree as ET

    import pytest

    files = gpu_test_files(root)
    xml = out.with_suffix(".xml")
    rc = int(pytest.main([*files, "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={xml}"]))
    res: dict[str, Any] = {"files": files, "exit_code": rc, "passed": 0, "failed": 0, "skipped": 0, "errors": 0,
                           "cases": []}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kids = {c.tag: c for c in case}
            outcome = next((k for k in ("failure", "error", "skipped") if k in kids), "passed")
            key = {"failure": "failed", "error": "errors", "skipped": "skipped", "passed": "passed"}[outcome]
            res[key] += 1
            msg = kids[outcome].get("message", "")[:300] if outcome in kids else ""
            res["cases"].append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": key,
                                 "seconds": float(case.get("time", 0)), "message": msg})
    # a skip (TransformerEngine, DeepEP and two-GPU tests on one GPU without them) fails nothing
    # but is no pass either: counted apart, listed with its reason, and the check's verdict is
    # "passed_with_skips"; a part whose every test skipped is itself "skipped". A failure, an
    # error or nothing collected fails the part.
    res["ok"] = rc == 0 and not res["failed"] and not res["errors"]
    if not res["ok"]:
        res["error"] = (f"pytest exit {rc}: {res['failed']} failed, {res['errors']} errors, {res['passed']} passed"
                        if rc != 5 else "no gpu-marked test collected")
    elif res["skipped"] and not res["passed"]:
        res["status"] = "skipped"
        res["reason"] = f"all {res['skipped']} gpu-marked tests skipped"
    out.write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fastsync GPU check")
    ap.add_argument("outdir", nargs="?", help="folder for gpu_check.json and gpu_check.log")
    ap.add_argument("--dry-run", action="store_true", help="check the install and the device; run no part")
    ap.add_argument("--quick", action="store_true", help="smaller runs (for a retry with little device time)")
    ap.add_argument("--cpu-rehearsal", action="store_true",
                    help="run every part's code on the CPU at toy sizes (not a measurement; for tests)")
    ap.add_argument("--site", help="folder the carried wheels were installed into (listed in the JSON)")
    ap.add_argument("--only", action="append", choices=sorted(PARTS), help="run only these parts")
    ap.add_argument("--run-gpu-tests", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    if args.run_gpu_tests:
        return _run_gpu_tests(Path(args.out), root)
    if not args.outdir:
        ap.error("give OUTDIR")
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    log = outdir / "gpu_check.log"
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    env, error = cuda_info()
    if args.cpu_rehearsal:
        env["cpu_rehearsal"] = True
        error = None
    env["cpu_count"] = os.cpu_count()
    env["quick"] = args.quick
    wheels = installed_dists(Path(args.site)) if args.site else []
    parts: dict[str, dict[str, Any]] = {}

    def write(err: str | None = None) -> dict[str, Any]:
        rep = assemble(parts=parts, env=env, wheels=wheels, dry_run=args.dry_run, started=started,
                       wall_s=time.monotonic() - t0, error=err)
        (outdir / "gpu_check.json").write_text(json.dumps(rep, indent=2, default=str))
        return rep

    if error is not None:
        write(error)
        print(f"gpu-check: {error}", file=sys.stderr)
        return 2
    names = args.only or list(PARTS)
    if args.dry_run:
        for n in names:
            parts[n] = {"status": "skipped", "seconds": 0.0, "exit_code": None, "error": "dry run", "result": None}
        write()
        print(f"gpu-check: dry run on {env.get('device')}: install and device checked, no part run")
        return 0
    signal.signal(signal.SIGTERM, _terminated)  # the outer deadline: the running part's group is killed too
    for n in names:
        module, extra, deadline = PARTS[n]
        if args.quick:
            extra, deadline = QUICK[n]
        if args.cpu_rehearsal:
            extra, deadline = CPU_REHEARSAL[n]
        result_path = outdir / f"part_{n}.json"
        print(f"gpu-check: part {n} (deadline {deadline:.0f} s) ...", flush=True)
        try:
            parts[n] = run_part(n, [sys.executable, "-m", module, "--out", str(result_path), *extra], deadline,
                                result_path, log, cwd=str(root))
        except _Terminated as e:
            parts[n] = {"status": "timeout", "seconds": None, "exit_code": None, "error": str(e), "result": None}
            write(str(e))
            print(f"gpu-check: {e}", file=sys.stderr)
            return 124
        print(f"gpu-check: part {n}: {parts[n]['status']} in {parts[n]['seconds']:.0f} s"
              + (f" ({parts[n]['error']})" if parts[n]["error"] else ""), flush=True)
        write()
    rep = write()
    print("gpu-check: summary " + json.dumps(rep["summary"], default=str))
    for line in summary_lines(rep):
        print(f"gpu-check: {line}")
    return EXIT_CODES[rep["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
