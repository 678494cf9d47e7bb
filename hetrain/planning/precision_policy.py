"""Which precision each device computes in: bf16 where the chip has it, fp16 with loss scaling
on chips without bf16 (V100, T4), tf32/fp32 when the user asks for them."""

from __future__ import annotations

from hetrain.errors import HetrainError
from hetrain.vocabulary import PRECISIONS

PRECISION_CHOICES = ("auto", *PRECISIONS)


def choose_precision(spec, requested: str = "auto") -> tuple[str, str | None]:
    """The precision `spec` will use for `requested`, and a note when it differs from the request."""
    if requested not in PRECISION_CHOICES:
        raise HetrainError(f"unknown precision {requested!r}; choose one of: {', '.join(PRECISION_CHOICES)}")
    if spec.arch == "cpu":
        return "fp32", (None if requested in ("auto", "fp32") else f"{spec.name} computes in fp32 (asked {requested})")
    if requested == "auto":
        return ("bf16", None) if spec.supports("bf16") else ("fp16", None)
    if spec.supports(requested) and spec.peak_flops.get(requested, 0.0) > 0:
        return requested, None
    fallback = {"bf16": "fp16", "tf32": "fp32"}.get(requested, "fp32")
    return fallback, f"{spec.name} has no {requested}; it uses {fallback}" + (
        " with loss scaling" if fallback == "fp16" else ""
    )


def needs_loss_scaling(precision: str) -> bool:
    """fp16 gradients underflow without a dynamic loss scale; bf16/tf32/fp32 do not."""
    return precision == "fp16"
