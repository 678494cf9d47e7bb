"""Emulated device speeds as a user writes them (`--emulate-speeds 1,0.5`): parsed without torch, so
that `hetrain launch` refuses a bad value at once."""

from __future__ import annotations

import math

from hetrain.errors import HetrainError


def parse_speeds(text: str) -> list[float]:
    """'1,0.5' -> [1.0, 0.5]; every speed must be a positive number."""
    speeds = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise HetrainError(f"speed {part!r} is not a number; write speeds like --emulate-speeds 1,0.5") from None
        if not math.isfinite(value):
            raise HetrainError(f"speed {part} must be a finite number above 0 (1 = full speed, 0.5 = half); got {value}")
        if not value > 0:
            raise HetrainError(f"speed {part} must be above 0 (1 = full speed, 0.5 = half); got {value}")
        speeds.append(value)
    if not speeds:
        raise HetrainError("no speeds given; write speeds like --emulate-speeds 1,0.5")
    return speeds
