"""The plugin manager and the registries the registration hooks fill.

Plugins come from the ``fastsync`` entry-point group (fastsync's built-ins are listed there too,
in pyproject.toml) or from ``register_plugin()`` at run time. Registries are filled lazily, on
first use, and rebuilt when plugins change.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from fastsync import hookspecs
from fastsync.errors import ConfigError, PluginError

__all__ = [
    "pm",
    "register_plugin",
    "unregister_plugin",
    "Registered",
    "transports",
    "layout_kinds",
    "model_presets",
    "architectures",
    "transforms",
    "get_transport_factory",
    "list_plugins",
]

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "fastsync"

pm = pluggy.PluginManager(hookspecs.PROJECT)
pm.add_hookspecs(hookspecs)
_lock = threading.RLock()
_loaded = False
_cache: dict[str, dict[str, "Registered"]] = {}


@dataclass(frozen=True, slots=True)
class Registered:
    """One registered thing: its name, the object, the plugin it came from, and extras."""

    name: str
    obj: Any
    plugin: str
    extra: dict


def _load_entry_points() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if pm.get_plugin(ep.name) is not None:
                continue
            try:
                mod = ep.load()
            except Exception as e:  # a broken plugin must say which one it is
                raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {e}") from e
            pm.register(mod, name=ep.name)


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object or module at run time; returns the name it is known by."""
    _load_entry_points()
    with _lock:
        got = pm.register(plugin, name=name)
        _cache.clear()
        return got


def unregister_plugin(name: str) -> None:
    with _lock:
        pm.unregister(name=name)
        _cache.clear()


def _plugin_name(impl: pluggy.HookImpl) -> str:
    return pm.get_name(impl.plugin) or repr(impl.plugin)


def _collect(hook_name: str) -> dict[str, Registered]:
    """Call a registration hook once per implementation, remembering which plugin registered
    what, and refusing clashes."""
    _load_entry_points()
    with _lock:
        if hook_name in _cache:
            return _cache[hook_name]
        out: dict[str, Registered] = {}
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            plugin = _plugin_name(impl)

            def register(name: str, obj: Any, *args: Any, _plugin: str = plugin, **extra: Any) -> None:
                if args:
                    extra["args"] = args
                if name in out:
                    raise PluginError(
                        f"{hook_name}: {name!r} registered by both {out[name].plugin!r} and {_plugin!r}"
                    )
                out[name] = Registered(name, obj, _plugin, extra)

            impl.function(register=register)
        _cache[hook_name] = out
        return out


def transports() -> dict[str, Registered]:
    """Transport name -> Registered(obj=factory, extra={'available': bool, 'why': str})."""
    return _collect("fastsync_register_transports")


def layout_kinds() -> dict[str, Registered]:
    """Layout kind -> Registered(obj=builder, extra={'side': 'trainer'|'engine'})."""
    return _collect("fastsync_register_layouts")


def model_presets() -> dict[str, Registered]:
    """Preset name -> Registered(obj=config_factory)."""
    return _collect("fastsync_register_models")


def architectures() -> dict[str, Registered]:
    """Architecture -> Registered(obj=enumerate_params, extra={'model_types': tuple[str, ...]})."""
    return _collect("fastsync_register_architectures")


def transforms() -> dict[str, Registered]:
    """Transform name -> Registered(obj=fn)."""
    return _collect("fastsync_register_transforms")


def get_transport_factory(name: str) -> Callable[..., Any]:
    """The factory for transport ``name``; ConfigError naming it (and what to install) otherwise."""
    regs = transports()
    if name not in regs:
        raise ConfigError(f"unknown transport {name!r}; registered: {sorted(regs)}")
    reg = regs[name]
    if not reg.extra.get("available", True):
        raise ConfigError(f"transport {name!r} (plugin {reg.plugin!r}) cannot run here: {reg.extra.get('why', '')}")
    return reg.obj


def hook() -> Any:
    """The hook relay, after entry-point plugins are loaded: ``hook().fastsync_name_map(...)``."""
    _load_entry_points()
    return pm.hook


def list_plugins() -> list[dict]:
    """What is registered and where it came from, for ``fastsync plugins``."""
    _load_entry_points()
    dists = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dists[ep.name] = ep.dist.name if ep.dist else "?"
    rows = []
    for name, plugin in pm.list_name_plugin():
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        rows.append({
            "name": name,
            "module": getattr(plugin, "__name__", type(plugin).__name__),
            "source": f"entry point ({dists[name]})" if name in dists else "registered at run time",
            "hooks": hooks,
        })
    return rows
