"""Emulated device speeds as a user writes them (`--emulate-speeds 1,0.5`): parsed without torch, so
that `hetrain launch` refuses a bad value at once."""

from __future__ import annotations

import math

from hetrain.errors import HetrainError


def parse_speeds(text: str, flag: str = "--emulate-speeds") -> list[float]:
    """'1,0.5' -> [1.0, 0.5]; every speed must be above 0 and at most 1 (full speed). `flag`: the option the
    user gave them with, named in the errors."""
    speeds, sep = [], " " if flag.startswith("-") else "="   # a flag's value, or an environment variable's
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise HetrainError(f"{flag}: speed {part!r} is not a number; write speeds like {flag}{sep}1,0.5") from None
        if not math.isfinite(value):
            raise HetrainError(f"{flag}: speed {part} must be a finite number above 0 (1 = full speed, 0.5 = half); "
                               f"got {value}")
        if not value > 0:
            raise HetrainError(f"{flag}: speed {part} must be above 0 (1 = full speed, 0.5 = half); got {value}")
        speeds.append(value)
    if not speeds:
        raise HetrainError(f"{flag}: no speeds given; write speeds like {flag}{sep}1,0.5")
    if max(speeds) > 1:
        fastest = max(speeds)
        scaled = ",".join(f"{v / fastest:.4g}" for v in speeds)
        raise HetrainError(f"{flag}: speed {fastest:g} is above 1, full speed: emulation only slows a rank down; "
                           f"give the fastest rank 1 and the others their fraction of it ({flag}{sep}{scaled})")
    return speeds
