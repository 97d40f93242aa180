"""Calls whose replies come back through fastsync's control store, for a host whose RPC drops
the workers' return values (verl's ``vLLMHttpServer.collective_rpc``).

The caller builds a request (:func:`store_request`: the method, its arguments, a fresh reply key
and the store's address with the job secret, which travels over the host's own channel) and
sends it through the host's RPC to every worker; each worker runs the call and puts its reply,
or ``{"error": [class, message]}``, under ``{reply}/{rank}`` (:func:`answer_to_store`); the
caller reads one reply per worker with a deadline and raises a worker's error by name
(:func:`store_replies`).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from typing import Any

from fastsync.control import TCPStoreControl
from fastsync.errors import ConfigError
from fastsync.host.replies import error_reply, raise_worker_errors

__all__ = ["store_request", "store_replies", "answer_to_store"]

_ids = itertools.count(1)


def store_request(control: TCPStoreControl, method: str, args: Sequence[Any], *, caller: str) -> dict:
    """A request for ``method(*args)`` whose replies go under a key unique to this call of ``caller``."""
    reply = f"store_rpc/{caller}/{next(_ids)}-{time.monotonic_ns()}"
    return {"method": method, "args": list(args), "reply": reply,
            "control": [control.host, control.port, control.secret.hex(), control.prefix]}


def store_replies(control: TCPStoreControl, request: dict, workers: int, what: str,
                  timeout_s: float = 30.0) -> list[Any]:
    """Every worker's reply to ``request`` (worker rank order), a worker's error raised by name."""
    got = [json.loads(control.get(f"{request['reply']}/{w}", timeout_s, what=f"{what} (reply of worker {w})"))
           for w in range(workers)]
    return raise_worker_errors(got, what)


def answer_to_store(worker: Any, request: dict, allowed: Sequence[str]) -> bool:
    """Inside a worker: run ``request["method"]`` (one of ``allowed``) on ``worker`` and put the
    reply in the store the request names; an error is answered, never raised (an exception in a
    vLLM worker kills the engine). The worker keeps one store client per address."""
    rank = int(getattr(worker, "rank", 0))
    try:
        method = str(request.get("method", ""))
        if method not in allowed:
            raise ConfigError(f"store call: method {method!r} is not one of {tuple(allowed)}")
        body = json.dumps(getattr(worker, method)(*list(request.get("args", []))))
    except Exception as e:  # noqa: BLE001 - answered, never raised
        body = json.dumps(error_reply(e))
    host, port, secret, prefix = request["control"]
    clients = worker.__dict__.setdefault("_fastsync_store_clients", {})
    key = (host, int(port), prefix)
    if key not in clients:
        clients[key] = TCPStoreControl.client(int(port), host=host, prefix=prefix, secret=secret)
    clients[key].set(f"{request['reply']}/{rank}", body)
    return True
