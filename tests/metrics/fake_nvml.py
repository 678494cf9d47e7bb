"""A stand-in for `pynvml` with one GPU: the calls hetrain makes, returning fixed or growing readings.

`unsupported` names the calls that raise NVMLError_NotSupported, as on a device that lacks them.
"""

from __future__ import annotations

from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_FEATURE_ENABLED = 1
NVML_FEATURE_DISABLED = 0
NVML_TEMPERATURE_GPU = 0
NVML_NVLINK_MAX_LINKS = 18
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139

UUID = "GPU-8f3a5c2e-1111-2222-3333-444455556666"
INDEX = 3
ACTIVE_LINKS = (0, 1, 2, 3)
ALL_LINKS = 0xFFFFFFFF


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """Module-like: `nvml.nvmlDeviceGetPowerUsage(handle)` and the constants above."""

    NVMLError = NVMLError

    def __init__(self, unsupported: tuple[str, ...] = ()) -> None:
        for name, value in globals().items():
            if name.startswith("NVML_"):
                setattr(self, name, value)
        self.unsupported = set(unsupported)
        self.kib_sent = 0
        self.init_calls = 0

    def _check(self, name: str) -> None:
        if name in self.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    def nvmlInit(self) -> None:
        self.init_calls += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != UUID:
            raise NVMLError(13)  # NVML_ERROR_NOT_FOUND
        return "handle"

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return UUID

    def nvmlDeviceGetIndex(self, handle: str) -> int:
        return INDEX

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=80 * 2**30, used=30 * 2**30, free=50 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        self._check("nvmlDeviceGetPowerUsage")
        return 312_500  # milliwatts

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature")
        return 64

    def nvmlDeviceGetNvLinkState(self, handle: str, link: int) -> int:
        self._check("nvmlDeviceGetNvLinkState")
        return NVML_FEATURE_ENABLED if link in ACTIVE_LINKS else NVML_FEATURE_DISABLED

    def nvmlDeviceGetFieldValues(self, handle: str, field_ids: list) -> list:
        """NVLink data counters in KiB: scopeId UINT_MAX is the total over the links, a link id its part."""
        self._check("nvmlDeviceGetFieldValues")
        self.kib_sent += 1000
        out = []
        for field_id, scope in field_ids:
            kib = self.kib_sent if field_id == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else 2 * self.kib_sent
            if scope != ALL_LINKS:
                kib //= len(ACTIVE_LINKS)
            out.append(SimpleNamespace(fieldId=field_id, scopeId=scope, nvmlReturn=NVML_SUCCESS,
                                       value=SimpleNamespace(ullVal=kib)))
        return out
