"""Per-device-kind rates a run measured, saved beside its checkpoints and metrics.

The balancer measures each rank's cost line (`fixed + n * per_sample` seconds per step). A run
writes them, grouped by the device kind each rank ran, to `measured-rates.json` in its run
directory (the checkpoint directory when there is one); `hetrain plan --from-run DIR` re-plans with
them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hetrain.errors import HetrainError
from hetrain.vocabulary import CPU_DEVICE, PRECISIONS

RATES_FILE = "measured-rates.json"
RATES_VERSION = 1


class DeviceRate(BaseModel):
    """What the ranks of one device kind measured (medians over those ranks)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    device: str = Field(description="catalog name of the device (or 'cpu')")
    precision: Literal[PRECISIONS]
    ranks: int = Field(ge=1, description="how many ranks of this kind ran")
    per_sample_seconds: float = Field(gt=0, description="compute seconds per sample")
    fixed_seconds: float = Field(ge=0, description="compute seconds per step that do not grow with the share")
    share: int = Field(ge=0, description="samples per step each rank of this kind took at the end")
    emulated: bool = Field(False, description="the speed was emulated on CPU ranks")


class MeasuredRates(BaseModel):
    """A run's measured rates, by device kind."""

    # model_params: no warning on pydantic < 2.10
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    version: int = RATES_VERSION
    step: int = Field(ge=0, description="the step at which they were measured")
    global_batch_size: int = Field(ge=1)
    devices: list[DeviceRate]
    model_params: int | None = Field(None, description="parameters of the model the run trained (None: not "
                                                        "recorded, or a pipeline stage's only)")

    @field_validator("version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != RATES_VERSION:
            raise ValueError(f"measured rates version {v} is not supported; this hetrain reads version {RATES_VERSION}")
        return v

    def check_model(self, params: float, name: str, source: str) -> None:
        """A run's rates hold for the model it trained only: another model is refused, naming both."""
        if self.model_params and params > 0 and not 0.9 <= params / self.model_params <= 1.1:
            raise HetrainError(
                f"{source} measured a model of {self.model_params:,} parameters, and this plan is for {name} "
                f"({int(params):,}): a run's rates hold for its own model only; plan the model it trained "
                "(--model NAME, --profile FILE, or --profiles DIR from hetrain profile --script FILE.py:FACTORY "
                "or --hf-config NAME_OR_PATH --out DIR), or leave out --from-run")

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / RATES_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "MeasuredRates":
        directory = Path(directory)
        path = directory / RATES_FILE if directory.is_dir() else directory
        if not path.is_file():
            raise HetrainError(
                f"{path} does not exist: a job writes it once its balancer has measured one re-split interval, "
                "and a job that does not balance (a pipeline plan, or balancing turned off) measures none; pass the "
                "run directory (or checkpoint directory) of a balanced job, or plan with --profiles DIR from "
                "hetrain profile"
            )
        from hetrain.planning.plan import unique_keys

        try:
            rates = cls.model_validate(json.loads(path.read_text(), object_pairs_hook=lambda p: unique_keys(p, str(path))))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HetrainError(f"{path}: not a measured-rates JSON file ({e})") from None
        except ValidationError as e:
            from hetrain.errors import format_validation_error

            raise HetrainError(f"{path}: {format_validation_error(e, cls, 'the measured rates a hetrain run writes')}"
                               ) from None
        from hetrain.hardware.catalog import get_gpu

        for d in rates.devices:
            if d.device != CPU_DEVICE:
                try:
                    get_gpu(d.device)
                except HetrainError:
                    raise HetrainError(f"{path}: device {d.device!r} is neither a catalog device nor 'cpu'; fix: the "
                                       "catalog name a run writes (hetrain devices --catalog lists them)") from None
        return rates
