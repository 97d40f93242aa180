"""Compact layout spec strings, for planning without a cluster.

Grammar (``KIND:ARGS``; ARGS is a comma-separated list of ``key=value``, ``keyVALUE`` such as
``tp8``, or a bare leading number for the world size; keys are case-insensitive)::

  trainer side
    fsdp:N[,dim=D]                  FSDP2 fully_shard over N ranks, Shard(D) for parameters with a
                                    dim D, Shard(0) for the rest (default D=0)
    hsdp:RxS | hsdp:replicate=R,shard=S
                                    HSDP: R replicas of S-way FSDP2 (rank = r*S + s)
    zero3:N                         DeepSpeed ZeRO-3 flat partitions over N ranks
    megatron:tpT[,ppP][,epE][,dpD]  Megatron TP x PP x DP (world T*P*D); experts over E ranks
                                    of each stage (E divides T*D), see fastsync.layout.trainer
    replicated:N | ddp:N            every rank holds every parameter whole

  engine side
    vllm:tpT[,dpD][,ep[=E]][,replicasR][,quant=fp8][,dtype=bfloat16][,moepadM]   (epE == ep=E)
        R independent vLLM engines ("replicas", alias "x"), each of T*D ranks: tensor parallel T,
        vLLM data parallel D. Dense/attention weights are split over T and replicated over D.
        Routed experts: without ``ep`` they are tensor parallel over all T*D ranks (vLLM flattens
        TP across DP for MoE); with ``ep`` (vLLM's enable_expert_parallel) each of the T*D ranks
        holds whole experts, placed linearly. vLLM's EP group is always the whole engine, so
        ``ep=E`` must equal T*D (with ``dp`` omitted, ``epE`` sets D = E/T). World size = T*D*R.
        Shapes are the engine's: the vocabulary padded to a multiple of 64 as vLLM pads it; with
        ``moepadM`` the fused-MoE intermediate size per partition is padded to a multiple of M as
        vLLM's CPU kernels do (M = 32); the plan records both shapes.

Examples: ``fsdp:256``, ``hsdp:2x64``, ``zero3:8``, ``megatron:tp8,pp2,ep4,dp2``,
``vllm:tp8`` (one TP8 engine), ``vllm:tp8,dp4,ep,replicas4`` = ``vllm:tp8,ep32,replicas4``
(128 GPUs: 4 engines of TP8 x DP4 with EP32 — the Kimi-K2 FP8 setup), ``vllm:tp8,replicas16``
(16 TP8 engines).

Kinds are looked up through ``fastsync.plugins.layout_kinds()``; fastsync's own register in
``fastsync._builtin.layouts`` like any plugin's. A bad spec raises ConfigError naming the field
and showing this grammar.
"""

from __future__ import annotations

import re

from fastsync.errors import ConfigError
from fastsync.layout.limits import MAX_WORLD_SIZE
from fastsync.layout.types import EngineLayout, TrainerLayout

__all__ = [
    "GRAMMAR",
    "parse_args",
    "trainer_layout_from_spec",
    "engine_layout_from_spec",
    "fsdp_builder",
    "hsdp_builder",
    "zero3_builder",
    "megatron_builder",
    "replicated_builder",
    "vllm_builder",
]

GRAMMAR = """\
  trainer: fsdp:N[,dim=D] | hsdp:RxS | zero3:N | megatron:tpT[,ppP][,epE][,dpD] | replicated:N
  engine:  vllm:tpT[,dpD][,ep | ,epE (E = T*D, EP over the whole engine)][,replicasR][,quant=fp8][,dtype=bf16|fp16|fp32][,moepad32 (vLLM CPU MoE padding)]
  examples: fsdp:256  hsdp:2x64  zero3:8  megatron:tp8,pp2,ep4,dp2  vllm:tp8,dp4,ep,replicas4 (= vllm:tp8,ep32,replicas4)"""

_ITEM = re.compile(r"^([a-z_]+?)=?([0-9]+)$")
#: Longest digit string a field may hold (anything longer is over every bound anyway).
_MAX_DIGITS = 9


def _digits(val: object) -> bool:
    return isinstance(val, str) and re.fullmatch(r"[0-9]+", val) is not None


def _err(spec: str, msg: str) -> ConfigError:
    return ConfigError(f"layout spec {spec!r}: {msg}\ngrammar:\n{GRAMMAR}")


def parse_args(spec: str, args: str, *, ints: tuple[str, ...], flags: tuple[str, ...] = (),
               strings: tuple[str, ...] = (), positional: str | None = None,
               aliases: dict[str, str] | None = None, max_int: int = MAX_WORLD_SIZE) -> dict[str, object]:
    """Parse ``args`` into a dict. ``positional`` names the key a bare leading number fills.
    Unknown keys, repeated keys, non-integers and integers over ``max_int`` (default: the world
    size bound) raise ConfigError naming the field."""
    aliases = aliases or {}
    out: dict[str, object] = {}
    items = [a.strip() for a in args.split(",")] if args.strip() else []
    for i, item in enumerate(items):
        low = item.lower()
        if not low:
            raise _err(spec, "empty field")
        if i == 0 and positional and re.fullmatch(r"[-+0-9.e_]+", low) and any(c in low for c in "0123456789"):
            key, val = positional, low  # a number: checked as the positional field below
        elif "=" in low and low.split("=", 1)[0] in (*strings, *(aliases.get(s, s) for s in strings)):
            key, val = low.split("=", 1)
        else:
            m = _ITEM.match(low)
            if m:
                key, val = m.group(1), m.group(2)
            elif "=" in low:
                key, val = low.split("=", 1)
            else:
                key, val = low, None
        key = aliases.get(key, key)
        if key in out:
            raise _err(spec, f"field {key!r} given twice")
        if key in flags and val is None:
            out[key] = True
        elif key in ints or (key in flags and val is not None):
            if val is None or not _digits(val) or int(val[:_MAX_DIGITS + 1]) < 1:
                raise _err(spec, f"field {key!r} must be a positive integer, got {val!r}")
            if len(val) > _MAX_DIGITS or int(val) > max_int:
                raise _err(spec, f"field {key!r} = {val} is over the limit {max_int}")
            out[key] = int(val)
        elif key in strings:
            if not val:
                raise _err(spec, f"field {key!r} needs a value")
            out[key] = val
        else:
            known = sorted({*ints, *flags, *strings})
            raise _err(spec, f"unknown field {key!r} (known for this kind: {known})")
    return out


def _check_world(spec: str, what: str, size: int) -> None:
    if size > MAX_WORLD_SIZE:
        raise _err(spec, f"world size {what} = {size} is over the limit {MAX_WORLD_SIZE} ranks")


def _require(spec: str, got: dict, key: str) -> int:
    if key not in got:
        raise _err(spec, f"missing field {key!r}")
    return int(got[key])  # type: ignore[arg-type]


# ---- built-in builders (registered in fastsync._builtin.layouts) ----------------------------


def fsdp_builder(args: str, inventory: object) -> TrainerLayout:
    from fastsync.layout.trainer import fsdp_layout

    spec = f"fsdp:{args}"
    got = parse_args(spec, args, ints=("n",), strings=("dim",), positional="n")
    dim = got.get("dim", "0")
    if not _digits(str(dim)) or len(str(dim)) > _MAX_DIGITS:
        raise _err(spec, f"field 'dim' must be a non-negative integer, got {dim!r}")
    params = getattr(inventory, "params", inventory)
    max_ndim = max((len(p.shape) for p in params.values()), default=0)  # type: ignore[union-attr]
    if int(str(dim)) >= max_ndim:
        raise _err(spec, f"field 'dim'={dim}: no parameter of this model has that dim (at most {max_ndim} dims)")
    return fsdp_layout(inventory, _require(spec, got, "n"), shard_dim=int(str(dim)))


def hsdp_builder(args: str, inventory: object) -> TrainerLayout:
    from fastsync.layout.trainer import hsdp_layout

    spec = f"hsdp:{args}"
    m = re.fullmatch(r"\s*([0-9]{1,9})\s*x\s*([0-9]{1,9})\s*", args.lower())
    if m:
        r, s = int(m.group(1)), int(m.group(2))
        if r < 1 or s < 1:
            raise _err(spec, "replicate and shard must be positive")
    else:
        got = parse_args(spec, args, ints=("replicate", "shard"), aliases={"r": "replicate", "s": "shard"})
        r, s = _require(spec, got, "replicate"), _require(spec, got, "shard")
    _check_world(spec, "replicate*shard", r * s)
    return hsdp_layout(inventory, r, s)


def zero3_builder(args: str, inventory: object) -> TrainerLayout:
    from fastsync.layout.trainer import zero3_layout

    spec = f"zero3:{args}"
    got = parse_args(spec, args, ints=("n",), positional="n")
    return zero3_layout(inventory, _require(spec, got, "n"))


def replicated_builder(args: str, inventory: object) -> TrainerLayout:
    from fastsync.layout.trainer import replicated_layout

    spec = f"replicated:{args}"
    got = parse_args(spec, args, ints=("n",), positional="n")
    return replicated_layout(inventory, _require(spec, got, "n"))


def megatron_builder(args: str, inventory: object) -> TrainerLayout:
    from fastsync.layout.trainer import megatron_layout

    spec = f"megatron:{args}"
    got = parse_args(spec, args, ints=("tp", "pp", "ep", "dp"))
    _check_world(spec, "tp*pp*dp", _require(spec, got, "tp") * int(got.get("pp", 1)) * int(got.get("dp", 1)))  # type: ignore[call-overload]
    return megatron_layout(inventory, tp=_require(spec, got, "tp"), pp=int(got.get("pp", 1)),  # type: ignore[arg-type]
                           ep=int(got.get("ep", 1)), dp=int(got.get("dp", 1)))  # type: ignore[arg-type]


def vllm_builder(args: str, inventory: object, name_map: object) -> EngineLayout:
    from fastsync.layout.engine import build_engine_layout

    spec = f"vllm:{args}"
    got = parse_args(spec, args, ints=("tp", "dp", "replicas", "moepad"), flags=("ep",), strings=("quant", "dtype"),
                     aliases={"x": "replicas", "r": "replicas", "moe_pad": "moepad"})
    tp = _require(spec, got, "tp")
    ep = got.get("ep", False)
    if "dp" in got:
        dp = int(got["dp"])  # type: ignore[arg-type]
    elif ep is not True and ep is not False and int(ep) % tp == 0:  # type: ignore[call-overload]
        dp = int(ep) // tp  # type: ignore[call-overload]
    else:
        dp = 1
    if ep is not True and ep is not False and ep != tp * dp:
        raise _err(spec, f"field 'ep'={ep}: vLLM's expert-parallel group is the whole engine, tp*dp = {tp * dp} "
                         f"ranks; write 'ep' (or ep={tp * dp}) and use replicasN for more engines, e.g. "
                         f"vllm:tp{tp},dp{dp},ep,replicas4")
    _check_world(spec, "tp*dp*replicas", tp * dp * int(got.get("replicas", 1)))  # type: ignore[call-overload]
    quant = got.get("quant")
    if quant not in (None, "fp8", "bf16", "none"):
        raise _err(spec, f"field 'quant' must be fp8 or bf16, got {quant!r}")
    dtype = str(got.get("dtype", "bfloat16"))
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise _err(spec, f"field 'dtype' must be bf16, fp16 or fp32 (the engine's weight dtype), got {dtype!r}")
    moe_pad = got.get("moepad")
    if moe_pad is not None and not 1 <= int(moe_pad) <= 4096:  # type: ignore[call-overload]
        raise _err(spec, f"field 'moepad' must be in 1..4096 (vLLM CPU's MoE kernels pad to 32), got {moe_pad}")
    return build_engine_layout(inventory, name_map, tp=tp, dp=dp, ep=bool(ep), replicas=int(got.get("replicas", 1)),  # type: ignore[arg-type]
                               dtype=dtype, quant="fp8" if quant == "fp8" else None,
                               moe_pad=None if moe_pad is None else int(moe_pad))  # type: ignore[call-overload]


# ---- dispatch ---------------------------------------------------------------------------------


def _split_spec(spec: str, side: str) -> tuple[str, str, object]:
    from fastsync import plugins

    if not isinstance(spec, str) or ":" not in spec:
        raise _err(str(spec), "expected KIND:ARGS")
    kind, args = spec.split(":", 1)
    kind = kind.strip().lower()
    kinds = plugins.layout_kinds()
    same_side = sorted(k for k, r in kinds.items() if r.extra.get("side") == side)
    reg = kinds.get(kind)
    if reg is None:
        raise _err(spec, f"unknown {side} layout kind {kind!r}; registered {side} kinds: {same_side}")
    if reg.extra.get("side") != side:
        raise _err(spec, f"{kind!r} is a {reg.extra.get('side')} layout, not a {side} one; {side} kinds: {same_side}")
    return kind, args, reg.obj


def trainer_layout_from_spec(spec: str, inventory: object) -> TrainerLayout:
    """The trainer layout a spec such as ``fsdp:256`` describes, validated."""
    _, args, builder = _split_spec(spec, "trainer")
    layout = builder(args, inventory)  # type: ignore[operator]
    if not isinstance(layout, TrainerLayout):
        raise ConfigError(f"layout spec {spec!r}: builder returned {type(layout).__name__}, not a TrainerLayout")
    return layout


def engine_layout_from_spec(spec: str, inventory: object, *, dtype_out: str = "bf16",
                            name_map: object = None) -> EngineLayout:
    """The engine layout a spec such as ``vllm:tp8,dp4,ep,replicas4`` describes, validated.
    ``dtype_out="fp8"`` quantises linear weights (same as ``quant=fp8`` in the spec)."""
    from fastsync.layout.namemap import get_name_map

    if dtype_out not in ("bf16", "fp8", "bfloat16"):
        raise ConfigError(f"dtype_out must be 'bf16' or 'fp8', got {dtype_out!r}")
    kind, args, builder = _split_spec(spec, "engine")
    if dtype_out == "fp8":
        quant_items = [a.strip().lower() for a in args.split(",") if a.strip().lower().startswith("quant")]
        if not quant_items:
            args = f"{args},quant=fp8" if args.strip() else "quant=fp8"
        elif quant_items != ["quant=fp8"]:
            raise ConfigError(f"layout spec {spec!r}: dtype_out (--dtype-out) fp8 conflicts with "
                              f"{', '.join(quant_items)} in the spec; give one of them")
    if name_map is None:
        name_map = get_name_map(inventory.architecture, inventory.config, inventory.params,  # type: ignore[attr-defined]
                                engine=kind)
    layout = builder(args, inventory, name_map)  # type: ignore[operator]
    if not isinstance(layout, EngineLayout):
        raise ConfigError(f"layout spec {spec!r}: builder returned {type(layout).__name__}, not an EngineLayout")
    return layout
