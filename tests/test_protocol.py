"""Every control-store key trainer and engine ranks meet under is built in ``fastsync.protocol``
(issue 40 part 3): no other module of the package formats one. The check reads every module's
string literals (f-strings included) with ``ast`` and refuses one that starts with a protocol
namespace; it is shown to fail on a line written here."""

from __future__ import annotations

import ast
import pathlib

import fastsync
from fastsync import protocol

#: the namespaces of fastsync.protocol's keys
NAMESPACES = ("recv/", "send/", "nixl/", "torch/send/", "rank0/shards/", "wt/", "engine/", "alive/", "rollout/",
              "barrier/")
ROOT = pathlib.Path(fastsync.__file__).parent


def _key_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string literal or f-string whose leading text starts a protocol key."""
    out = []
    tree = ast.parse(source)
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if id(node) in parts:  # a piece of an f-string, read with it
            continue
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            text = head.value if isinstance(head, ast.Constant) and isinstance(head.value, str) else ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if text.startswith(NAMESPACES) and "\n" not in text and " " not in text:
            out.append((node.lineno, text))
    return out


def test_only_the_protocol_module_formats_keys() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == pathlib.Path(protocol.__file__):
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {text!r}" for line, text in _key_literals(path.read_text())]
    assert not found, "keys formatted outside fastsync.protocol:\n" + "\n".join(found)


def test_the_check_catches_a_key_formatted_elsewhere() -> None:
    assert _key_literals('control.set(f"recv/{rank}/begun/{v}", b"1")\nlog.info("recv/ done")') == [(1, "recv/")]


def test_every_key_function_is_listed_and_keys_do_not_collide() -> None:
    fns = [getattr(protocol, n) for n in protocol.__all__]
    assert sorted(n for n in vars(protocol) if n.endswith("_key")) == sorted(protocol.__all__)
    made = set()
    for fn in fns:
        args = [3, 5][: fn.__code__.co_argcount]
        if fn.__code__.co_varnames[:1] in (("name",), ("role",), ("engine_id",)):
            args = ["x", *args[1:]]
        key = fn(*args)
        assert key.startswith(NAMESPACES) or fn.__name__.startswith("setup_"), (fn.__name__, key)
        assert key not in made, (fn.__name__, key)
        made.add(key)
