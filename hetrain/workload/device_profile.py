"""A measured device profile: what one model costs on one device kind, timed by `hetrain profile`.

One JSON file per device kind (`<device>.json` in a profile directory, beside `workload.json`, the
model's WorkloadProfile). It holds step seconds at several micro-batch sizes per precision, the
peak memory of each, per-block seconds (what a pipeline partition needs), and the stamp of the
machine that measured it (device, driver, torch and CUDA versions), so a planner can say which of
its figures were measured and on what.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hetrain.errors import HetrainError
from hetrain.hardware.catalog import get_gpu

DEVICE_PROFILE_VERSION = 1
WORKLOAD_FILE = "workload.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())   # model_params: older pydantic warns


class StepTiming(_Strict):
    """One micro-batch size in one precision: forward + backward seconds, and peak memory."""

    precision: str
    micro_batch: int = Field(ge=1)
    seconds: float = Field(gt=0, description="median seconds of one forward + backward of micro_batch samples")
    peak_memory_bytes: int | None = Field(None, ge=0, description="device memory at the peak (CUDA only)")
    cpu_seconds: float | None = Field(None, ge=0, description="median process CPU seconds of the same (CPU only): "
                                      "the work itself, whatever else loads the machine")


class BlockTiming(_Strict):
    """One block's forward + backward seconds at a micro-batch size."""

    name: str
    precision: str
    micro_batch: int = Field(ge=1)
    seconds: float = Field(ge=0)


class Stamp(_Strict):
    """Where and with what the profile was measured."""

    device_name: str = Field(description="the device as torch reports it")
    driver: str | None = None
    torch: str
    cuda: str | None = None
    cudnn: str | None = None
    threads: int | None = Field(None, description="CPU threads torch used")
    concurrent_copies: int = Field(1, ge=1, description="copies timed at once on the CPU (as ranks share it)")
    hostname: str | None = None
    date: str = Field(description="UTC, ISO 8601")


class DeviceProfile(_Strict):
    """Measured costs of one model on one device kind."""

    version: int = DEVICE_PROFILE_VERSION
    model: str = Field(description="the workload's name (as in workload.json)")
    model_params: int | None = Field(None, ge=0, description="the workload's parameters")
    workload_id: str | None = Field(None, description="the workload's identity (WorkloadProfile.identity(): "
                                    "its parameters and each input tensor's dtype and shape of one sample); None "
                                    "in profiles written before it")
    device: str = Field(description="catalog name of the device kind, or 'cpu'")
    stamp: Stamp
    steps: list[StepTiming]
    optimizer_seconds: float = Field(0.0, ge=0, description="one optimizer step (AdamW) over all parameters")
    blocks: list[BlockTiming] = Field(default_factory=list)

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != DEVICE_PROFILE_VERSION:
            raise ValueError(f"device profile version {v} is not supported; this hetrain reads version "
                             f"{DEVICE_PROFILE_VERSION}: re-run hetrain profile")
        return v

    @field_validator("device")
    @classmethod
    def _catalog_name(cls, v: str) -> str:
        """An alias or another case ("A100") is the catalog's name, as the planner looks it up; a name the catalog
        lacks stays (a cluster file's own device)."""
        if v.strip().lower() == "cpu":
            return "cpu"
        try:
            return get_gpu(v).name
        except HetrainError:
            return v

    def precisions(self) -> list[str]:
        return sorted({s.precision for s in self.steps})

    def points(self, precision: str) -> list[tuple[int, float]]:
        """(micro_batch, seconds) measured in `precision`, by micro-batch."""
        return sorted((s.micro_batch, s.seconds) for s in self.steps if s.precision == precision)

    def cpu_time_view(self) -> "DeviceProfile":
        """This profile with CPU seconds in place of wall seconds (where they were measured)."""
        return self.model_copy(update={"steps": [s.model_copy(update={"seconds": s.cpu_seconds or s.seconds})
                                                 for s in self.steps]})

    def peak_points(self, precision: str) -> list[tuple[int, int]]:
        """(micro_batch, peak device bytes) measured in `precision` (CUDA profiles), by micro-batch."""
        return sorted((s.micro_batch, s.peak_memory_bytes) for s in self.steps
                      if s.precision == precision and s.peak_memory_bytes is not None)

    def disturbed_note(self) -> str | None:
        """One line when a larger micro-batch was timed faster than a smaller one (`falling_times`)."""
        found = [(p, f) for p in self.precisions() for f in falling_times(self.points(p))]
        if not found:
            return None
        p, (b0, v0, b1, v1) = found[0]
        return (f"the {self.device} profile timed {p} micro-batch {b1} faster than micro-batch {b0} "
                f"({v1:.3f} s against {v0:.3f} s): other load on the machine disturbed it, and its figures "
                "are not to be trusted; re-run hetrain profile on an idle machine (or with more --repeats)")

    def microbatch_seconds(self, precision: str, micro_batch: float) -> float:
        """Seconds of one micro-batch of `micro_batch` samples: linear between measured sizes, the
        line through the two nearest measured sizes beyond them (never below zero)."""
        pts = self.points(precision)
        if not pts:
            raise HetrainError(f"the {self.device} profile has no {precision} timings; "
                               f"re-run hetrain profile with --precision {precision}")
        return interpolate(pts, micro_batch)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / f"{self.device}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "DeviceProfile":
        path = Path(path)
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HetrainError(f"{path}: not a readable device profile ({e}); write one with hetrain profile") from None
        except ValidationError as e:
            from hetrain.errors import format_validation_error

            raise HetrainError(f"{path}: {format_validation_error(e, cls, 'a device profile: hetrain profile writes them')}"
                               ) from None


def interpolate(points: list[tuple[int, float]], micro_batch: float) -> float:
    """A figure at `micro_batch` from figures measured at sorted micro-batch sizes: linear between
    them, the line through the two nearest beyond them (never below zero; below the smallest size,
    never below the proportional share of its figure; above the largest, never below the largest's
    figure, and where the last two fall by more than `falling_times`' tolerance, in proportion to
    the largest's figure: more samples never take less time, and such a fall comes from a
    measurement disturbed by other load); one point scales in proportion."""
    if micro_batch <= 0:
        return 0.0
    if len(points) == 1:
        mb, v = points[0]
        return v * micro_batch / mb
    i = 1
    while i < len(points) - 1 and points[i][0] < micro_batch:
        i += 1
    (b0, v0), (b1, v1) = points[i - 1], points[i]
    if micro_batch < b0:
        return max(v0 + (v1 - v0) / (b1 - b0) * (micro_batch - b0), v0 * micro_batch / b0)
    if micro_batch > b1:
        if falling_times([(b0, v0), (b1, v1)]):   # disturbed: no line to extend
            return v1 * micro_batch / b1
        return v1 + max(0.0, (v1 - v0) / (b1 - b0)) * (micro_batch - b1)   # never below the largest's time
    return max(0.0, v0 + (v1 - v0) / (b1 - b0) * (micro_batch - b0))


def falling_times(points: list[tuple[int, float]], tolerance: float = 0.1) -> list[tuple[int, float, int, float]]:
    """Pairs of sorted (micro-batch, seconds) where the larger micro-batch took less time than the
    smaller one by more than `tolerance` of it: (small, its seconds, large, its seconds). More
    samples cannot take less time; such timings were disturbed (other load on the machine)."""
    out = []
    for (b0, v0), (b1, v1) in zip(points, points[1:]):
        if b1 > b0 and v1 < v0 * (1.0 - tolerance):
            out.append((b0, v0, b1, v1))
    return out


_PROFILE_KEYS = ("device", "stamp", "steps")


def _other_document(path: Path) -> str | None:
    """What a JSON file beside the profiles is, where it is a JSON object with none of a device profile's
    own keys (a plan saved there with --out): "a plan", or "no device profile"; None for one to read as a
    profile (a broken one is refused when read)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or any(k in doc for k in _PROFILE_KEYS):
        return None
    if ("ranks" in doc and "global_batch_size" in doc) or "plan" in doc:
        return "a plan"
    return "a workload profile" if "flops_per_sample" in doc or "params" in doc else "no device profile"


def load_profiles(directory: str | Path, skipped: list[str] | None = None) -> dict[str, DeviceProfile]:
    """Every device profile in `directory`, by device kind. Other JSON documents there (a plan saved beside
    the profiles) are left out, with a line each in `skipped`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HetrainError(f"--profiles {str(directory)!r} is not a directory; pass the directory "
                           "hetrain profile --out wrote")
    found: dict[str, DeviceProfile] = {}
    paths: dict[str, Path] = {}
    for path in sorted(directory.glob("*.json")):
        if path.name == WORKLOAD_FILE:
            continue
        other = _other_document(path)
        if other is not None:
            if skipped is not None:
                skipped.append(f"{path} is {other} (it has no {', '.join(_PROFILE_KEYS)}): left out of the profiles")
            continue
        prof = DeviceProfile.load(path)
        if prof.device in found:   # an older profile kept beside the new one: which is meant?
            raise HetrainError(f"{paths[prof.device]} and {path} are both profiles of {prof.device} (measured "
                               f"{found[prof.device].stamp.date} and {prof.stamp.date}); fix: keep one of them in "
                               f"{directory}")
        found[prof.device], paths[prof.device] = prof, path
    if not found:
        others = [p for p in sorted(directory.glob("*.json")) if p.name != WORKLOAD_FILE]
        left = f" ({others[0].name} is {_other_document(others[0])}, left out)" if others else ""
        raise HetrainError(f"{directory} holds no device profiles{left}; run hetrain profile --out {directory}")
    return found
