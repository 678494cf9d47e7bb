"""Argument types for the benchmarks' options: a value out of range is refused by argparse in one
error line naming the option, before any rank starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole(least: int) -> Callable[[str], int]:
    """A whole number of at least `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    parse.__name__ = f"whole number >= {least}"
    return parse


def number(above: float | None = None, least: float | None = None, most: float | None = None) -> Callable[[str], float]:
    """A finite number above `above` (or at least `least`), and at most `most`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be more than {above:g}, got {value:g}")
        if least is not None and value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least:g}, got {value:g}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {value:g}")
        return value

    parse.__name__ = "number"
    return parse


def wholes(least: int = 1) -> Callable[[str], list[int]]:
    """Comma-separated whole numbers, each at least `least` (e.g. 32,128,512)."""
    def parse(text: str) -> list[int]:
        items = [item.strip() for item in text.split(",")]
        values = []
        for item in items:
            try:
                value = int(item)
            except ValueError:
                where = "" if item == text else f" in {text!r}"
                raise argparse.ArgumentTypeError(
                    f"{item!r}{where} is not a whole number; write whole numbers of at least {least}, "
                    "comma-separated, e.g. 32,128,512") from None
            if value < least:
                raise argparse.ArgumentTypeError(f"each must be at least {least}, got {value} in {text!r}")
            values.append(value)
        return values

    parse.__name__ = f"comma-separated whole numbers >= {least}"
    return parse
