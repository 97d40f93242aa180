"""Test bridge for verl's CPU gap: verl 0.9.1 has no CPU platform and falls back to CUDA
(``get_device_id()`` -> ``torch.cuda.current_device()``). This registers one through verl's own
``PlatformRegistry`` and selects it with ``VERL_PLATFORM=cpu``; call :func:`use_cpu_platform`
in every process that runs verl code, before verl first resolves its platform. Not part of the
adapter: on GPUs verl's own platform is used."""

from __future__ import annotations

import os

import torch


def use_cpu_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is None:

        @PlatformRegistry.register(platform="cpu")
        class PlatformCPU(PlatformBase):
            device_name = "cpu"
            vendor_name = "cpu"
            device_module = torch.cpu

            def is_available(self) -> bool:
                return True

            def is_platform_available(self, use_smi_check: bool = False) -> bool:
                return True

            def current_device(self):  # type: ignore[override]
                return "cpu"  # what .to(device) needs

            def device_count(self) -> int:
                return 1

            def set_device(self, device_index: int) -> None: ...
            def synchronize(self, device_index=None) -> None: ...
            def empty_cache(self) -> None: ...

            def manual_seed(self, seed: int) -> None:
                torch.manual_seed(seed)

            def manual_seed_all(self, seed: int) -> None:
                torch.manual_seed(seed)

            def communication_backend_name(self) -> str:
                return "gloo"

            def visible_devices_envvar(self) -> str:
                return "CPU_VISIBLE_DEVICES_UNUSED"

            def is_ipc_supported(self) -> bool:
                return False

            def get_device_capability(self, device_index: int = 0):
                return (None, None)

            def set_allocator_settings(self, settings: str) -> None: ...
            def nvtx_range(self, msg: str):
                import contextlib

                return contextlib.nullcontext()

            def profiler_start(self) -> None: ...
            def profiler_stop(self) -> None: ...

            def ray_resource_name(self) -> str:
                return "CPU"

            def ray_noset_envvars(self) -> list[str]:
                return []

            def cudart(self):
                return None

    os.environ["VERL_PLATFORM"] = "cpu"
