"""The import direction of ARCHITECTURE.md, enforced: every ``fastsync`` import (static, read with
``ast``, lazy imports inside functions included, ``if TYPE_CHECKING:`` blocks excluded) goes from a
package to its own package or to a package in a lower layer, never up or sideways.

The checker runs on the real package and, to show it can fail, on a small tree written here with a
deliberate upward import (``layout`` importing the sync lifecycle) and a sideways one.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import fastsync

#: Bottom to top. A package may import its own modules and any package of a LOWER layer only;
#: packages in the same layer do not import each other. A new package must be placed here.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("hookspecs", "security", "protocol", "procs"),  # pluggy markers and specs (types only under TYPE_CHECKING);
    # the job secret; every control-store key trainer and engine ranks meet under; how rank processes start
    ("store",),  # the control store's authenticated key/value server and its torch.distributed.Store
    ("control", "plugins", "trace"),  # control-plane store; plugin manager and registries; spans, trace files, plots, progress
    ("layout",),  # boxes, trainer/engine layouts, name-map types, spec strings, engine tensors' JSON
    ("models", "plan", "moe"),  # parameter inventories; the planner; MoE layer swaps
    ("executor",),  # data-plane primitives: programs, packing, staging, transforms, pipeline
    ("transport",),  # NIXL / torch.distributed / rank-0 byte movers
    ("sync",),  # the lifecycle: WeightSync, sender, receiver, gather, handshake
    ("reload", "route", "host"),  # peer reload; rolling updates, version routing; the host kit adapters stand on
    ("engines",),  # one package per inference engine (vllm/)
    ("_builtin",),  # built-in plugin registrations
    ("bench", "demo"),  # benchmark harnesses; the demo
    ("cli", "gpu"),  # the command line; the GPU check (scripts/gpu_check.sh)
    ("",),  # fastsync/__init__.py: the public API, above everything
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """ast.walk without the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _top_package(module: str, root: str, tree_root: pathlib.Path) -> str:
    """``fastsync.layout.box`` -> ``layout``; ``fastsync.errors`` -> ``errors``; ``fastsync`` -> ``""``."""
    parts = module.split(".")
    assert parts[0] == root
    return parts[1] if len(parts) > 1 else ""


def _imports(path: pathlib.Path, module: str, is_pkg: bool, root: str, tree_root: pathlib.Path) -> list[tuple[str, int]]:
    """(imported fastsync module, line) for every runtime import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if is_pkg else module.rsplit(".", 1)[0]
    out: list[tuple[str, int]] = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == root]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != root:
                continue
            if target == root:  # ``from fastsync import plugins`` imports the submodule
                for a in node.names:
                    sub = tree_root / a.name
                    if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                        out.append((f"{root}.{a.name}", node.lineno))
                    else:
                        out.append((root, node.lineno))
            else:
                out.append((target, node.lineno))
    return out


def violations(tree_root: pathlib.Path) -> list[str]:
    """Every import in the package at ``tree_root`` that breaks LAYERS, as readable lines."""
    root = tree_root.name
    bad: list[str] = []
    for path in sorted(tree_root.rglob("*.py")):
        rel = path.relative_to(tree_root.parent).with_suffix("")
        is_pkg = path.name == "__init__.py"
        module = ".".join(rel.parts[:-1] if is_pkg else rel.parts)
        src = _top_package(module, root, tree_root)
        if src not in RANK:
            bad.append(f"{path}: package {src!r} has no layer in LAYERS")
            continue
        for target, line in _imports(path, module, is_pkg, root, tree_root):
            dst = _top_package(target, root, tree_root)
            if dst == src:
                continue
            if dst not in RANK:
                bad.append(f"{path}:{line}: imports {target} whose package {dst!r} has no layer")
            elif RANK[dst] >= RANK[src]:
                how = "upward" if RANK[dst] > RANK[src] else "sideways"
                bad.append(f"{path}:{line}: {module} imports {target} ({how}: {src!r} -> {dst!r})")
    return bad


def test_fastsync_imports_only_downward():
    assert violations(pathlib.Path(fastsync.__file__).parent) == []


def test_every_package_has_a_layer():
    top = pathlib.Path(fastsync.__file__).parent
    names = {p.stem for p in top.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert names <= set(RANK), sorted(names - set(RANK))


def _write(root: pathlib.Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")


@pytest.fixture
def fake_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "fastsync"
    _write(root, "__init__.py", "from fastsync.errors import FastSyncError\n")
    _write(root, "errors.py", "class FastSyncError(Exception): ...\n")
    _write(root, "plugins.py", "from fastsync import errors\n")
    _write(root, "layout/__init__.py", "")
    _write(root, "layout/box.py", "from fastsync.errors import FastSyncError\nfrom . import types\n")
    _write(root, "layout/types.py", "def f():\n    from fastsync import plugins\n")
    _write(root, "sync/__init__.py", "")
    _write(root, "sync/sender.py", "from fastsync.layout.box import f\nfrom ..transport import base\n")
    _write(root, "transport/__init__.py", "")
    _write(root, "transport/base.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from fastsync.sync.sender import WeightSender\n")
    return root


def test_checker_accepts_a_clean_tree(fake_tree: pathlib.Path):
    assert violations(fake_tree) == []


def test_checker_fails_on_an_upward_import(fake_tree: pathlib.Path):
    # layout reaching up into the sync lifecycle, lazily inside a function (as the old code did)
    _write(fake_tree, "layout/engine.py", "def g():\n    from fastsync.sync.sender import x\n")
    bad = violations(fake_tree)
    assert len(bad) == 1 and "upward: 'layout' -> 'sync'" in bad[0] and "engine.py:2" in bad[0]


def test_checker_fails_on_a_relative_upward_and_a_sideways_import(fake_tree: pathlib.Path):
    _write(fake_tree, "transport/rank0.py", "from ..sync import sender\n")  # transport -> sync
    _write(fake_tree, "plan/__init__.py", "")
    _write(fake_tree, "plan/planner.py", "import fastsync.models.inventory\n")  # plan -> models
    bad = violations(fake_tree)
    assert any("upward: 'transport' -> 'sync'" in b for b in bad), bad
    assert any("sideways: 'plan' -> 'models'" in b for b in bad), bad
    assert len(bad) == 2, bad


def test_checker_fails_on_an_unplaced_package(fake_tree: pathlib.Path):
    _write(fake_tree, "relay/__init__.py", "")
    assert any("package 'relay' has no layer" in b for b in violations(fake_tree))


# ---- no import circle between modules (a lazy import inside a function counts) ------------------
def _module_graph(tree_root: pathlib.Path) -> dict[str, set[str]]:
    root = tree_root.name
    mods: dict[str, pathlib.Path] = {}
    for path in sorted(tree_root.rglob("*.py")):
        rel = path.relative_to(tree_root.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if path.name == "__init__.py" else rel.parts)] = path
    return {m: {t for t, _ in _imports(p, m, p.name == "__init__.py", root, tree_root) if t in mods and t != m}
            for m, p in mods.items()}


def circles(tree_root: pathlib.Path) -> list[list[str]]:
    """Every set of modules that import each other round a circle (Tarjan's strongly connected
    components of more than one module), sorted."""
    graph = _module_graph(tree_root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle():
    assert circles(pathlib.Path(fastsync.__file__).parent) == []


def test_circle_finder_finds_a_lazy_circle(fake_tree: pathlib.Path):
    assert circles(fake_tree) == []
    _write(fake_tree, "layout/spec.py", "from fastsync.layout.box import f\n")
    _write(fake_tree, "layout/box.py", "def f():\n    import fastsync.layout.spec\n")  # lazy, inside a function
    assert circles(fake_tree) == [["fastsync.layout.box", "fastsync.layout.spec"]]


# ---- engines and host frameworks stay above the engine layer ---------------------------------------
#: Third-party packages only ``engines/`` (and the layers above it) may import: the engine-side
#: session (``sync/engine_session.py``) and everything below ``engines`` are engine-agnostic.
ENGINE_PACKAGES = ("vllm", "sglang", "verl", "openrlhf")  # (Ray is the host kit's runtime: allowed)


def engine_imports(tree_root: pathlib.Path) -> list[str]:
    """Every runtime import of an engine or host framework from a package below ``engines``."""
    bad: list[str] = []
    for path in sorted(tree_root.rglob("*.py")):
        rel = path.relative_to(tree_root)
        top = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else ""
        if RANK.get(top, len(LAYERS)) >= RANK["engines"]:
            continue
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] in ENGINE_PACKAGES]
    return bad


def test_no_engine_imports_below_the_engines():
    assert engine_imports(pathlib.Path(fastsync.__file__).parent) == []


def test_engine_import_checker_fails_on_vllm_in_the_session(fake_tree: pathlib.Path):
    _write(fake_tree, "sync/engine_session.py", "def f():\n    from vllm.distributed import get_tp_group\n")
    bad = engine_imports(fake_tree)
    assert len(bad) == 1 and "engine_session.py:2: imports vllm.distributed" in bad[0], bad
