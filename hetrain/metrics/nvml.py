"""GPU readings through NVML (nvidia-ml-py's `pynvml`), taken when Prometheus scrapes, never per step.

Optional: without `pynvml` installed (`pip install 'hetrain[gpu]'`) or without a driver, a CUDA
rank exports no `hetrain_gpu_*` series. A reading the device does not support is left out, never
reported as zero.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

KIB = 1024
ALL_LINKS = 0xFFFFFFFF


def load_nvml() -> ModuleType | None:
    """The initialised `pynvml` module, or None when it is not installed or no driver answers."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.info("NVML unavailable (%s); no hetrain_gpu_* metrics", e)
        return None
    return pynvml


class NvmlDevice:
    """One GPU as NVML sees it: its UUID and index (DCGM's `UUID` and `gpu`) and its readings."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        uuid = nvml.nvmlDeviceGetUUID(handle)
        self.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        self.index = int(nvml.nvmlDeviceGetIndex(handle))
        self.nvlinks = self._active_links()

    @classmethod
    def by_uuid(cls, nvml: Any, uuid: str) -> "NvmlDevice":
        """The device with this UUID ('GPU-...'; torch's bare UUID is accepted too)."""
        if not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        return cls(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid))

    def _active_links(self) -> list[int]:
        links = []
        for link in range(getattr(self.nvml, "NVML_NVLINK_MAX_LINKS", 0)):
            try:
                if self.nvml.nvmlDeviceGetNvLinkState(self.handle, link) == self.nvml.NVML_FEATURE_ENABLED:
                    links.append(link)
            except self.nvml.NVMLError:
                continue
        return links

    def _try(self, fn, *args) -> Any:
        try:
            return fn(self.handle, *args)
        except self.nvml.NVMLError:
            return None

    def _nvlink_bytes(self, field_id: int) -> float | None:
        if not self.nvlinks:
            return None
        # scopeId UINT_MAX asks NVML for the counter summed over all links (a link id gives that link's)
        values = self._try(self.nvml.nvmlDeviceGetFieldValues, [(field_id, ALL_LINKS)])
        if values is None or values[0].nvmlReturn != self.nvml.NVML_SUCCESS:
            return None
        return float(values[0].value.ullVal * KIB)

    def sample(self) -> dict[str, float]:
        """Metric name -> value for every reading this device gives now."""
        out: dict[str, float] = {}
        util = self._try(self.nvml.nvmlDeviceGetUtilizationRates)
        if util is not None:
            out["hetrain_gpu_utilization_ratio"] = util.gpu / 100.0
        mem = self._try(self.nvml.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            out["hetrain_gpu_memory_used_bytes"] = float(mem.used)
        power = self._try(self.nvml.nvmlDeviceGetPowerUsage)
        if power is not None:
            out["hetrain_gpu_power_watts"] = power / 1000.0
        temp = self._try(self.nvml.nvmlDeviceGetTemperature, self.nvml.NVML_TEMPERATURE_GPU)
        if temp is not None:
            out["hetrain_gpu_temperature_celsius"] = float(temp)
        for name, field_name in (("hetrain_gpu_nvlink_sent_bytes_total", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"),
                                 ("hetrain_gpu_nvlink_received_bytes_total", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX")):
            value = self._nvlink_bytes(getattr(self.nvml, field_name))
            if value is not None:
                out[name] = value
        return out
