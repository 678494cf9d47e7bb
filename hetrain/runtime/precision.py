"""Each rank in its own precision, one loss scale for the whole job.

Master weights and optimizer state stay fp32; `autocast()` enters the rank's autocast. When any
rank of the job computes in fp16, every rank multiplies its loss by the same job-wide scale, so
DDP averages gradients that are all at one scale, and the gradients are divided by it once,
before clipping and the optimizer step (`hetrain.runtime.gradients`). Whether a step's gradients
are finite is all-reduced, so every rank skips the same steps and moves the scale identically
(docs/design.md, invariants 1 and 4). The scale follows `torch.amp.GradScaler`'s rule (halve on an
overflow, double after `growth_interval` good steps) with a floor: it never falls below
`min_scale`, so a run of overflows cannot reach a scale of zero.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetrain.errors import HetrainError, format_validation_error

log = logging.getLogger("hetrain")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _AutocastSeen(TorchFunctionMode):
    """Notes whether any torch function of a forward runs under autocast (one the model enters itself too)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.seen = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.seen and torch.is_autocast_enabled(self.device_type):
            self.seen = True
        return func(*args, **(kwargs or {}))


class PrecisionWatch:
    """Forward hooks that look once, at the first training forward, at the autocast it runs under: a
    bf16/fp16 rank whose forward runs without autocast anywhere (not around the model, nor inside its
    forward: a torch function mode watches that one forward) computes in fp32 (the same update, slower,
    with the memory of fp32 activations); a job with no fp16 rank (so no loss scale) whose forward runs
    under the script's own fp16 autocast underflows small gradients to zero unscaled (1.1% of them
    exactly zero in a measured run). The hooks go at the end of that forward. A plain object, so the
    script's model still pickles, and a copy of the model carries inert hooks on its root only."""

    def __init__(self, device_type: str, precision: str, job_has_fp16: bool) -> None:
        self.device_type = device_type
        self.precision = precision
        self.job_has_fp16 = job_has_fp16
        self.handles: list[Any] = []
        self.mode: _AutocastSeen | None = None
        self.done = False

    def attach(self, model: torch.nn.Module) -> None:
        self.handles = [model.register_forward_pre_hook(self.before),
                        model.register_forward_hook(self.after, always_call=True)]   # a forward that raises too

    def before(self, module: torch.nn.Module, args: Any) -> None:
        if self.done or self.mode is not None or not torch.is_grad_enabled():   # an evaluation: no gradient
            return
        enabled = torch.is_autocast_enabled(self.device_type)
        if enabled and not self.job_has_fp16 and torch.get_autocast_dtype(self.device_type) == torch.float16:
            log.warning("the forward runs under fp16 autocast, and no rank of this plan is fp16, so the job keeps "
                        "no loss scale: small fp16 gradients underflow to zero; use `with session.autocast():` "
                        "(each rank in its plan's precision) or plan fp16 for this device (hetrain plan "
                        "--precision fp16)")
        if enabled or self.precision not in _DTYPES:
            self._finish()
            return
        self.mode = _AutocastSeen(self.device_type)   # autocast the model enters inside its forward counts too
        self.mode.__enter__()

    def after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        if output is None:   # the forward raised (an out-of-memory, say): the next one tells
            return
        self._finish()
        if not mode.seen:
            log.warning("this rank's plan computes in %s, and its forward runs without autocast, so in fp32 (the "
                        "same update, slower and with fp32 activations): run the forward inside `with "
                        "session.autocast():`", self.precision)

    def _finish(self) -> None:
        self.done = True   # the first training forward tells
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __getstate__(self) -> dict:   # a copy of the model (deepcopy, AveragedModel) carries an inert watch
        return {**self.__dict__, "handles": [], "mode": None, "done": True}


def watch_precision(model: torch.nn.Module, device: torch.device, precision: str, job_has_fp16: bool) -> None:
    """Look at the first training forward of `model` for the autocast its plan asks for (or a risky one)."""
    if precision in _DTYPES or not job_has_fp16:
        PrecisionWatch(device.type, precision, job_has_fp16).attach(model)


# the operations between a GradScaler's multiply and the loss passed on: reductions, shape and dtype changes,
# a division or sum by the script (loss functions and the model's own operations stop the search)
_THROUGH = ("DivBackward", "SumBackward", "MeanBackward", "SqueezeBackward", "UnsqueezeBackward", "ViewBackward",
            "ReshapeAlias", "UnsafeViewBackward", "CloneBackward", "ToCopyBackward", "AddBackward", "SubBackward",
            "MulBackward1", "ExpandBackward", "SelectBackward")


def check_not_prescaled(loss: torch.Tensor) -> None:
    """Refuse a loss the script already multiplied by a `torch.amp.GradScaler`'s scale, found through the
    loss's last reductions, shape changes, sums and divisions (`scaler.scale(loss) / 2`, `+ aux`,
    `.mean()`): scaled twice, every step overflowed and was skipped, then one update came 65536 times
    too large. The scale is one float32 value, a power of two of 1024 or more, as the scaler keeps it."""
    todo, seen = [getattr(loss, "grad_fn", None)], 0
    while todo and seen < 16:
        fn = todo.pop()
        seen += 1
        if fn is None:
            continue
        name = fn.name()
        if name == "MulBackward0":
            _refuse_a_scale(getattr(fn, "_saved_other", None))
            _refuse_a_scale(getattr(fn, "_saved_self", None))
        elif name.startswith(_THROUGH):
            todo += [f for f, _ in fn.next_functions if f is not None]


def _refuse_a_scale(other: Any) -> None:
    if not (isinstance(other, torch.Tensor) and other.numel() == 1 and other.dtype == torch.float32
            and not other.requires_grad):
        return
    value = float(other)
    if value >= 1024 and math.isfinite(value) and math.log2(value).is_integer():
        raise HetrainError(
            f"session.backward() was given a loss multiplied by a tensor of {value:g}, as a GradScaler scales it "
            "(scaler.scale(loss)): the session keeps the loss scale itself, for every rank; pass the loss as "
            "it is and drop the script's GradScaler (scaler.step and scaler.update go too); pass a mean loss "
            "and its item count (num_items), not a sum")


class LossScale(BaseModel):
    """The job's dynamic loss scale, set as torch's `GradScaler` is (used when a rank of the plan is fp16):
    `Session(loss_scale={"init_scale": 1024, "growth_interval": 500})`. A resumed run takes the
    checkpoint's scale and count of good steps."""

    model_config = ConfigDict(extra="forbid")
    init_scale: float = Field(2.0**16, gt=0, allow_inf_nan=False)
    growth_factor: float = Field(2.0, gt=1, allow_inf_nan=False)
    backoff_factor: float = Field(0.5, gt=0, lt=1)
    growth_interval: int = Field(2000, ge=1)
    min_scale: float = Field(1.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _starts_above_its_floor(self) -> "LossScale":
        if self.init_scale < self.min_scale:
            raise ValueError(f"init_scale {self.init_scale:g} is below min_scale {self.min_scale:g}, the floor the "
                             "scale never goes under: raise init_scale or lower min_scale")
        return self


def loss_scale_settings(value: "LossScale | dict | None") -> LossScale | None:
    """The settings a script gave (None: none given, torch's defaults with a floor of 1), or one line saying
    what is wrong."""
    if value is None or isinstance(value, LossScale):
        return value
    try:
        return LossScale.model_validate(value)
    except ValidationError as e:
        raise HetrainError(f"Session(loss_scale=...): {format_validation_error(e, LossScale)}") from None


def job_loss_scaler(enabled: bool, settings: LossScale | None, *, warn: bool) -> "JobLossScaler":
    """The job's loss scale (enabled when a rank of the plan is fp16); settings given to a job without one are
    said to be unused, once (`warn`)."""
    if settings is not None and not enabled and warn:
        log.warning("Session(loss_scale=...) is unused: no rank of this plan is fp16 (bf16 and fp32 need no loss "
                    "scale)")
    return JobLossScaler(enabled, settings)


class JobLossScaler:
    """A dynamic loss scale shared by every rank: same value, same backoffs, same growth."""

    def __init__(self, enabled: bool, settings: LossScale | None = None, **overrides: Any) -> None:
        """`settings` (a `LossScale`; its defaults when None), with `overrides` of its fields."""
        s = LossScale(**{**(settings.model_dump() if settings is not None else {}), **overrides})
        self.enabled = enabled
        self.scale = s.init_scale if enabled else 1.0
        self.growth_factor = s.growth_factor
        self.backoff_factor = s.backoff_factor
        self.growth_interval = s.growth_interval
        self.min_scale = s.min_scale
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def update(self, finite: bool) -> None:
        """After a step: back off on an overflow (down to the floor), grow after a run of good steps."""
        if not self.enabled:
            return
        if not finite:
            self.good_steps = 0
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        """This scale's own state, or a torch GradScaler's (`scaler.state_dict()` of a run before hetrain: its
        scale and its count of good steps since the last growth; {} where that scaler was disabled)."""
        if not state:
            return
        good_steps = state["good_steps"] if "good_steps" in state else state.get("_growth_tracker", 0)
        if self.enabled and state.get("enabled", True):
            self.scale = max(float(state["scale"]), self.min_scale)
        self.good_steps = int(good_steps)


@contextlib.contextmanager
def autocast(precision: str, device: torch.device, sharding: str = "none") -> Iterator[None]:
    """The rank's autocast region: bf16/fp16 autocast, or nothing for fp32/tf32.

    Under FSDP2 (`sharding` "fsdp") autocast keeps no cache of its weight casts. Its cache holds the 16-bit
    cast of every leaf parameter until the region ends, and FSDP2's gathered parameters are leaves: with
    activation checkpointing, where nothing else keeps the casts, each rank held a 16-bit copy of the whole
    model through the forward (2 bytes a parameter of the model, where its shard is 4 / ranks), 478 MB more
    than its blocks' on a 201M-parameter model over 2 ranks, against 93 MB without the cache. The casts
    are the same either way, so is the update; a weight used twice in one forward is cast twice.
    """
    dtype = _DTYPES.get(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=sharding != "fsdp"):
        yield


def configure_tf32(precision: str, device: torch.device) -> None:
    """TF32 matmuls where the chip has them and the plan allows (tf32, bf16, fp16 ranks)."""
    if device.type == "cuda":
        allow = precision != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow
