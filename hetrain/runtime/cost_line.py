"""A rank's cost line, ``fixed + n * per_sample``: its slope fitted on the intervals the balancer kept,
and the line through a measured point. Pure functions: every rank reaches the same model."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetrain.planning.batch_split import RankCost


def fit_slope(history: Sequence[tuple[float, float]], min_spread: float = 1.1,
              max_rel_error: float = 0.1) -> float | None:
    """The per-sample slope of ``fixed + n * per_sample`` by least squares over (samples, seconds)
    pairs, or None unless it is well determined: four or more points over shares that differ by
    ``min_spread``, a standard error within ``max_rel_error`` of the slope, and a positive slope and
    fixed part. (A slope too flat from noise would move the split too far and make it swing.)"""
    points = [(n, t) for n, t in history if n > 0 and math.isfinite(t) and t > 0]
    if len(points) < 4:
        return None
    ns = [n for n, _ in points]
    if max(ns) < min_spread * min(ns):
        return None
    mean_n = sum(ns) / len(ns)
    mean_t = sum(t for _, t in points) / len(points)
    var = sum((n - mean_n) ** 2 for n in ns)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
    if slope <= 0 or mean_t - slope * mean_n < 0:
        return None
    residual = sum((t - mean_t - slope * (n - mean_n)) ** 2 for n, t in points) / (len(points) - 2)
    if math.sqrt(residual / var) > max_rel_error * slope:
        return None
    return slope


FLOOR_AT_MOST = 0.95    # of a measured step's time: the floor taken under a line, so its samples cost something


def anchored_cost(n: float, t: float, slope: float | None, floor: float = 0.0) -> RankCost:
    """The cost line through the measured point (n samples in t seconds) with the given slope; without a slope,
    or with one steeper than the point allows (its line would pass 0 samples below ``floor``, the least a step
    of the rank takes: its optimizer step, which a rank at 0 samples runs too), the line through the point and
    (0, floor). A step's fixed part is its optimizer step and more, so that line is as steep as the truth or
    steeper, and a split it moves does not pass the balance point; without a floor it goes through the origin."""
    floor = min(max(floor, 0.0), FLOOR_AT_MOST * t) if math.isfinite(floor) else 0.0
    if slope is None or slope * n > t - floor:
        return RankCost(per_sample=(t - floor) / n, fixed=floor)
    return RankCost(per_sample=slope, fixed=t - slope * n)
