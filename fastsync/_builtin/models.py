"""Built-in plugin: the built-in architectures and model presets (published configs of real models), registered through the
``fastsync`` entry-point group like any third-party plugin."""

from __future__ import annotations

import copy
from collections.abc import Callable

from fastsync.hookspecs import hookimpl
from fastsync.models.archs import ARCHITECTURES, MODEL_TYPES
from fastsync.models.presets import PRESETS


@hookimpl
def fastsync_register_architectures(register: Callable[..., None]) -> None:
    for arch, fn in ARCHITECTURES.items():
        register(arch, fn, model_types=tuple(t for t, a in MODEL_TYPES.items() if a == arch))


@hookimpl
def fastsync_register_models(register: Callable[..., None]) -> None:
    for name, config in PRESETS.items():
        register(name, lambda config=config: copy.deepcopy(config))
