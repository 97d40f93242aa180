"""The one exception tree fastsync raises.

Every error names what went wrong: the parameter, rank, key, backend or plugin. Callers catch
``FastSyncError`` to handle anything fastsync refuses; the subclasses say which stage refused.
"""

from __future__ import annotations

__all__ = [
    "FastSyncError",
    "ConfigError",
    "LayoutError",
    "PlanError",
    "TransportError",
    "SyncError",
    "PluginError",
    "MoEPatchError",
    "error_wire",
    "error_from_wire",
    "error_text",
    "error_from_text",
    "raise_error_text",
]


class FastSyncError(Exception):
    """Base of every error fastsync raises on purpose."""


class ConfigError(FastSyncError):
    """A setting, spec string, preset name or CLI flag is invalid."""


class LayoutError(FastSyncError):
    """A layout does not describe the model: a parameter is uncovered, overlaps, or mismatches."""


class PlanError(FastSyncError):
    """No valid schedule exists for these layouts, or a plan does not match the layouts it meets."""


class TransportError(FastSyncError):
    """A transport could not set up, register memory, or move bytes."""


class SyncError(FastSyncError):
    """A weight sync failed or timed out; receivers keep their previous complete version."""


class PluginError(FastSyncError):
    """A plugin failed to load or registered something that clashes with another plugin."""


class MoEPatchError(FastSyncError):
    """A MoE layer swap was asked for with settings it cannot honour."""


# ---- errors on the wire ------------------------------------------------------------------------
# An error crosses a process boundary in one of two envelopes, both built here: a worker's RPC
# reply ``{"error": [class, message]}`` (``fastsync.host.replies``) and a control-store value
# ``err:{class}:{message}`` (set-up and weight-transfer keys). Either way it is raised again on
# the other side as the same fastsync class, its message prefixed with who answered.

def error_wire(e: BaseException) -> tuple[str, str]:
    """``(class name, message)``: a FastSyncError keeps its class; anything else (a vLLM
    RuntimeError, a TypeError from bad arguments) travels as SyncError naming its own type."""
    if isinstance(e, FastSyncError):
        return type(e).__name__, str(e)
    return "SyncError", f"{type(e).__name__}: {e}"


def error_from_wire(cls_name: str, message: str, prefix: str) -> FastSyncError:
    """The exception :func:`error_wire` described, as the fastsync class it names (a name that is
    not one of fastsync's classes, as sent by a peer, becomes FastSyncError): ``prefix: message``."""
    cls = globals().get(cls_name) if cls_name in __all__ else None
    if not (isinstance(cls, type) and issubclass(cls, FastSyncError)):
        cls = FastSyncError
    return cls(f"{prefix}: {message}")


def error_text(e: BaseException) -> str:
    """``e`` as a control-store value: ``err:{class}:{message}``."""
    cls_name, message = error_wire(e)
    return f"err:{cls_name}:{message}"


def error_from_text(raw: bytes | str, prefix: str) -> FastSyncError:
    """The exception an ``err:{class}:{message}`` value describes (``raw`` starts with ``err:``)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    cls_name, _, message = text.removeprefix("err:").partition(":")
    return error_from_wire(cls_name, message, prefix)


def raise_error_text(raw: bytes | str, prefix: str) -> None:
    """Raise what :func:`error_text` wrote."""
    raise error_from_text(raw, prefix)
