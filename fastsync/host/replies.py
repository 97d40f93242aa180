"""What engine workers answer over any RPC, in one place: an error as ``{"error": [class,
message]}`` (never raised inside a worker: an exception there kills vLLM's engine), the caller
raising it again as that fastsync error, and every worker of an engine on one weight version.
Used by the vLLM worker extension, every engine handle (``RpcEngine``, verl's server, HTTP) and
the adapters."""

from __future__ import annotations

from typing import Any

from fastsync.errors import SyncError, error_from_wire, error_wire

__all__ = ["error_reply", "raise_worker_errors", "one_version"]


def error_reply(e: BaseException) -> dict:
    """The ``{"error": [class name, message]}`` reply for an exception raised while answering a
    request (inside a worker's ``collective_rpc`` or in :func:`serve`), so the caller gets an
    answer, not a dead engine or a reply that never comes (the envelope: ``errors.error_wire``)."""
    return {"error": list(error_wire(e))}


def raise_worker_errors(results: list[Any], what: str) -> list[Any]:
    """Re-raise the first ``{"error": [cls, msg]}`` a worker returned, as that fastsync error."""
    for r in results:
        if isinstance(r, dict) and "error" in r:
            cls_name, msg = r["error"]
            raise error_from_wire(str(cls_name), str(msg), what)
    return results


def one_version(versions: list[Any], who: str) -> int:
    """The one weight version every worker of an engine reports (``fastsync_version`` over any
    RPC: ``collective_rpc``, a Ray actor call, HTTP); SyncError naming ``who`` and the versions
    when the workers disagree (a torn engine must never be served as one version)."""
    got = sorted({int(v) for v in versions})
    if len(got) != 1:
        raise SyncError(f"{who}: workers serve different versions {got}" if got else f"{who}: no worker answered")
    return got[0]
