"""Fast, identical-valued fingerprints of layouts and plans.

``TrainerLayout.fingerprint()``, ``EngineLayout.fingerprint()`` and ``Plan.json_hash()`` (the
contracts) build nested lists and ``json.dumps(sort_keys=True)`` them: for Kimi-K2 on
256 -> 128 ranks that is seconds of CPU. These functions write the very same JSON text directly,
caching the text of boxes and of engine tensors shared between ranks (replicas hold the same
objects), and hash it the same way, so their values are equal to the contracts' (tests check
this on random layouts). ``Plan.plan_hash``, which every rank checks at set-up, is
:func:`plan_hash`; the executor may keep calling the layouts' contract methods.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from fastsync.layout.box import Box
from fastsync.layout.types import EngineLayout, TrainerLayout

if TYPE_CHECKING:  # Plan.plan_hash calls plan_hash below
    from fastsync.plan.types import Plan

__all__ = ["trainer_fingerprint", "engine_fingerprint", "plan_hash"]

_q = json.dumps  # a string exactly as json.dumps writes it (escapes, ensure_ascii)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Boxes(dict):
    """Box -> its JSON text, written on first use (boxes repeat across ranks and replicas)."""

    def __missing__(self, b: Box) -> str:
        s = self[b] = "[" + ",".join(f"[{lo},{hi}]" for lo, hi in b) + "]"
        return s


class _Names(dict):
    """String -> its JSON text (quoted, escaped), written on first use."""

    def __missing__(self, n: str) -> str:
        s = self[n] = _q(n)
        return s


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def trainer_fingerprint(layout: TrainerLayout) -> str:
    """Equal to ``layout.fingerprint()``."""
    box, q = _Boxes(), _Names()
    params = ",".join(f"{q[n]}:[{_shape(p.shape)},{q[p.dtype]}]" for n, p in sorted(layout.params.items()))
    shards = ",".join(
        q[n] + ":[" + ",".join(f"[{s.rank},{box[s.box]},{s.local_offset}]" for s in sh) + "]"
        for n, sh in sorted(layout.shards.items())
    )
    text = (f'{{"kind":{q[layout.kind]},"params":{{{params}}},"shards":{{{shards}}},'
            f'"world_size":{layout.world_size}}}')
    return _digest(text)


def engine_fingerprint(layout: EngineLayout) -> str:
    """Equal to ``layout.fingerprint()``."""
    box, q = _Boxes(), _Names()
    frag: dict[tuple[str, int], str] = {}

    def tensor(n: str, t: object) -> str:
        key = (n, id(t))
        s = frag.get(key)
        if s is None:
            pieces = ",".join(f"[{box[p.dst_box]},{q[p.src]},{box[p.src_box]},{q[p.transform]}]" for p in t.pieces)  # type: ignore[attr-defined]
            logical = getattr(t, "logical_shape", None)
            tail = "" if logical is None else "," + _shape(logical)
            s = frag[key] = f"{q[n]}:[{_shape(t.shape)},{q[t.dtype]},[{pieces}]{tail}]"  # type: ignore[attr-defined]
        return s

    replica = ",".join(f"{q[str(r)]}:{v}" for r, v in sorted((str(r), v) for r, v in layout.replica_of.items()))
    ranks = sorted((str(r), ts) for r, ts in layout.tensors.items())
    per_dict: dict[int, str] = {}  # replicas share one dict of tensors: write its text once

    def rank_text(ts: dict) -> str:
        body = per_dict.get(id(ts))
        if body is None:
            body = per_dict[id(ts)] = ",".join(tensor(n, t) for n, t in sorted(ts.items(), key=lambda x: x[0]))
        return body

    tensors = ",".join(q[r] + ":{" + rank_text(ts) + "}" for r, ts in ranks)
    text = (f'{{"kind":{q[layout.kind]},"replica_of":{{{replica}}},"tensors":{{{tensors}}},'
            f'"world_size":{layout.world_size}}}')
    return _digest(text)


def plan_hash(plan: Plan) -> str:
    """Equal to ``plan.json_hash()`` (and what ``plan.plan_hash`` returns)."""
    box, q = _Boxes(), _Names()
    flag = {True: "true", False: "false"}
    gathers = ",".join(f"{q[n]}:{r}" for n, r in sorted(plan.gathers.items()))
    transfers = ",".join([
        f"[{t.src_rank},{t.dst_rank},{q[t.dst_tensor]},{box[t.dst_box]},{q[t.src_param]},{box[t.src_box]},"
        f"{q[t.transform]},{t.nbytes},{flag[bool(t.gathered)]}]"
        for t in plan.transfers
    ])
    fan = ""
    if plan.fanout is not None:  # replicas fed by trainers or relayed: part of the plan's identity
        f = plan.fanout
        fan = (f'"fanout":[{f.replica_size},{f.replicas},[{",".join(map(str, f.parents))}],'
               f'[{",".join(map(str, f.direct))}]],')
    pad = ""
    if plan.padded:  # engine-padded tensors: part of the plan's identity
        pad = '"padded":{' + ",".join(
            q[str(r)] + ":{" + ",".join(f"{q[n]}:[{_shape(lg)},{_shape(en)}]" for n, (lg, en) in sorted(ts.items())) + "}"
            for r, ts in sorted((str(r), ts) for r, ts in plan.padded.items())) + "},"
    text = (f'{{"engine_hash":{q[plan.engine_hash]},{fan}"gathers":{{{gathers}}},"num_receivers":{plan.num_receivers},'
            f'"num_trainers":{plan.num_trainers},{pad}"trainer_hash":{q[plan.trainer_hash]},'
            f'"transfers":[{transfers}],"version":1}}')
    return _digest(text)
