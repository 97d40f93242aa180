"""``make gpu-wheels``: the wheels the GPU machine lacks, downloaded for it (x86-64, CPython 3.12)
and trimmed to what the check loads, so they travel with the working tree (64 MiB in all).

Run on a machine with PyPI::

    python -m fastsync.gpu.wheels [--dest gpu_wheels] [--list scripts/gpu_wheels.txt]

``nixl-cu13`` 1.5.1 is 56 MiB as published, 27 MiB of it ``nixl_ep_cu13`` (NIXL's expert-parallel
kernels, one build per torch version, which fastsync does not import) and 2 MiB UCX's perftest
module: those are dropped and the wheel rewritten with a matching RECORD, same name and version.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from fastsync.errors import ConfigError
from fastsync.gpu.report import read_wheel_list

__all__ = ["PLATFORM", "PYTHON_VERSION", "TRIM", "download", "trim_wheel", "main"]

PLATFORM = "manylinux_2_28_x86_64"
PYTHON_VERSION = "3.12"
#: per distribution (normalised name): path prefixes inside the wheel that the check never loads
TRIM: dict[str, tuple[str, ...]] = {
    "nixl_cu13": ("nixl_ep_cu13/", "nixl_cu13.libs/ucx/libucx_perftest"),
}
#: the carried folder must leave room for the working tree in the 64 MiB the device tool moves
MAX_TOTAL_BYTES = 48 << 20


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def trim_wheel(path: Path, drop: tuple[str, ...]) -> tuple[int, int]:
    """Rewrite the wheel at ``path`` without members under ``drop`` (RECORD rewritten to match).
    Returns (bytes before, bytes after)."""
    path = Path(path)
    before = path.stat().st_size
    tmp = path.with_suffix(".trim")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        names = zin.namelist()
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ConfigError(f"{path.name}: expected one .dist-info/RECORD, found {len(records)}")
        kept = [n for n in names if n != records[0] and not n.startswith(drop)]
        if len(kept) == len(names) - 1:
            raise ConfigError(f"{path.name}: nothing under {drop} to drop (has the wheel's layout changed?)")
        rows = []
        for n in kept:
            data = zin.read(n)
            zout.writestr(zin.getinfo(n), data, compress_type=zipfile.ZIP_DEFLATED)
            if not n.endswith("/"):
                rows.append(f"{n},{_record_hash(data)},{len(data)}")
        rows.append(f"{records[0]},,")
        zout.writestr(records[0], "\n".join(rows) + "\n")
    tmp.replace(path)
    return before, path.stat().st_size


def download(pins: list[tuple[str, str]], dest: Path, pip: list[str]) -> list[Path]:
    """``pip download`` each pin for CPython 3.12 on x86-64 Linux, binary only, no dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = pip + ["download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:", "--no-deps",
                 "--python-version", PYTHON_VERSION, "--implementation", "cp", "--platform", PLATFORM,
                 "--dest", str(dest)] + [f"{n}=={v}" for n, v in pins]
    subprocess.run(cmd, check=True)
    got = []
    for name, version in pins:
        hits = sorted(dest.glob(f"{_norm(name)}-{version}-*.whl"))
        if not hits:
            raise ConfigError(f"pip download left no wheel for {name}=={version} in {dest}")
        got.append(hits[0])
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default="gpu_wheels")
    ap.add_argument("--list", default="scripts/gpu_wheels.txt")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    pins = read_wheel_list(Path(args.list))
    for old in dest.glob("*.whl"):  # exactly the listed wheels, nothing stale
        old.unlink()
    wheels = download(pins, dest, [sys.executable, "-m", "pip"])
    total = 0
    for w in wheels:
        drop = TRIM.get(w.name.split("-")[0])
        if drop:
            before, after = trim_wheel(w, drop)
            print(f"trimmed {w.name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB (dropped {', '.join(drop)})")
        size = w.stat().st_size
        total += size
        print(f"{size / 2**20:7.2f} MiB  {w.name}")
    print(f"{total / 2**20:7.2f} MiB  in {dest}/ ({len(wheels)} wheels)")
    if total > MAX_TOTAL_BYTES:
        raise ConfigError(f"{dest}/ holds {total / 2**20:.1f} MiB, over the {MAX_TOTAL_BYTES >> 20} MiB that leaves "
                          "room for the working tree in the device tool's 64 MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
