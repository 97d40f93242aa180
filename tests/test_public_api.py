"""The public API: every name in ``fastsync.__all__`` resolves, ``import fastsync`` stays light,
and the verl adapter lives on public names only."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import fastsync

ADAPTER = pathlib.Path(__file__).resolve().parents[1] / "adapters" / "verl" / "fastsync_verl"


def test_every_public_name_resolves():
    missing = [n for n in fastsync.__all__ if getattr(fastsync, n, None) is None]
    assert missing == []


def test_import_fastsync_is_light():
    code = ("import sys, fastsync; heavy = [m for m in ('torch', 'vllm', 'nixl', 'torch.distributed') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _fastsync_imports(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastsync":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "fastsync"]
    return out


def test_verl_adapter_uses_only_public_names():
    files = sorted(ADAPTER.glob("*.py"))
    assert files, ADAPTER
    bad = []
    for f in files:
        for line, module, names in _fastsync_imports(f):
            if module != "fastsync":
                bad.append(f"{f.name}:{line}: imports internal module {module}")
            bad += [f"{f.name}:{line}: {n} is not in fastsync.__all__" for n in names if n not in fastsync.__all__]
        text = f.read_text(encoding="utf-8")
        for attr in ast.walk(ast.parse(text)):
            if (isinstance(attr, ast.Attribute) and isinstance(attr.value, ast.Name) and attr.value.id == "fastsync"
                    and attr.attr not in fastsync.__all__):
                bad.append(f"{f.name}:{attr.lineno}: fastsync.{attr.attr} is not public")
    assert bad == []
