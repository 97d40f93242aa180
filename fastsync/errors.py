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
