"""verl 0.9.1 knows CUDA, NPU and ROCm platforms only and falls back to CUDA on a machine with
none, so its engine cannot build on a CPU. This registers a CPU platform (gloo, torch.cpu) under
VERL_PLATFORM=cpu so that verl's own workers and engine run unmodified in the tests."""

from __future__ import annotations

import contextlib
import os

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CPUDeviceModule:
    """torch.cpu with the memory queries verl calls on torch.cuda (a CPU has no allocator stats)."""

    def __getattr__(self, name):
        if name.startswith(("memory_", "max_memory_", "reset_")) or name in ("empty_cache", "ipc_collect"):
            return lambda *args, **kwargs: 0
        if name == "get_device_name":
            return lambda *args, **kwargs: "CPU"
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        return getattr(torch.cpu, name)


@PlatformRegistry.register("cpu")
class CPUPlatform(PlatformBase):
    device_name = "cpu"
    vendor_name = "none"
    device_module = _CPUDeviceModule()

    def is_available(self) -> bool:
        return True

    def current_device(self):
        # verl moves modules with .to(device=current_device()): an index would mean cuda:N
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


os.environ["VERL_PLATFORM"] = "cpu"
os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl registers its FSDP engine for cuda and npu only; the class itself is device-agnostic
