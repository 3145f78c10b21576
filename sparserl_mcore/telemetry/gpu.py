"""GPU memory and utilisation through NVML (nvidia-ml-py), silent where there is no NVIDIA GPU.

`GpuMonitor.sample()` returns {} on CPU machines, when NVML cannot start, or when the device is
gone, so callers just merge its dict into their metrics without checking anything.
"""

from __future__ import annotations

import functools


@functools.cache
def _nvml():
    """The initialised pynvml module, or None when NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return None
    return pynvml


class GpuMonitor:
    """Reads one device (this rank's local GPU index) per `sample()` call."""

    def __init__(self, device_index: int = 0, *, enabled: bool = True) -> None:
        self.device_index = device_index
        nvml = _nvml() if enabled else None
        self._handle = None
        if nvml is not None and device_index < nvml.nvmlDeviceGetCount():
            self._handle = nvml.nvmlDeviceGetHandleByIndex(device_index)

    @property
    def available(self) -> bool:
        return self._handle is not None

    def sample(self) -> dict[str, float]:
        """gpu/mem_used_gib, gpu/mem_total_gib, gpu/util_pct for the device; {} without one."""
        if self._handle is None:
            return {}
        nvml = _nvml()
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(self._handle)
            util = nvml.nvmlDeviceGetUtilizationRates(self._handle)
        except nvml.NVMLError:
            return {}
        gib = float(1 << 30)
        return {
            "gpu/mem_used_gib": mem.used / gib,
            "gpu/mem_total_gib": mem.total / gib,
            "gpu/util_pct": float(util.gpu),
        }
