"""How a global batch is cut into integer per-rank shares.

One function serves the planner (before the job) and the balancer (while it runs), so plan time
and run time cannot disagree. Each rank's step time is modelled as affine in its share,
``t_r(n) = fixed_r + n * per_sample_r``; the split minimises the slowest rank's time exactly over
integer shares within per-rank bounds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hetrain.errors import HetrainError


@dataclass(frozen=True)
class RankCost:
    """A rank's step time as a function of its share: ``fixed + n * per_sample`` seconds."""

    per_sample: float
    fixed: float = 0.0

    def time(self, n: int) -> float:
        return self.fixed + n * self.per_sample if n > 0 else 0.0


def _bounds(total: int, ranks: int, min_share, max_share) -> tuple[np.ndarray, np.ndarray]:
    lo = np.broadcast_to(np.asarray(min_share if min_share is not None else 0, dtype=np.int64), (ranks,)).copy()
    if max_share is None:
        hi = np.full(ranks, total, dtype=np.int64)
    else:
        hi = np.broadcast_to(np.asarray(max_share, dtype=np.int64), (ranks,)).copy()
    if (lo < 0).any():
        raise HetrainError(f"min_share must be >= 0, got {lo.tolist()}")
    if (hi < lo).any():
        raise HetrainError(f"max_share {hi.tolist()} is below min_share {lo.tolist()} for some rank")
    if lo.sum() > total:
        raise HetrainError(
            f"global batch {total} is smaller than the minimum shares add up to ({int(lo.sum())} over "
            f"{ranks} ranks); raise the global batch size to at least {int(lo.sum())} or lower min_share"
        )
    if hi.sum() < total:
        raise HetrainError(
            f"global batch {total} does not fit: the ranks take at most {int(hi.sum())} samples together "
            f"(max_share {hi.tolist()}); lower the global batch, add devices, or use gradient accumulation"
        )
    return lo, hi


def split_min_max(
    total: int,
    costs: Sequence[RankCost],
    min_share: int | Sequence[int] | None = 0,
    max_share: int | Sequence[int] | None = None,
) -> list[int]:
    """Integer shares summing to ``total`` that minimise ``max_r costs[r].time(share_r)``.

    Exact: bisection on the step time finds, for a time just below the optimum, how many samples
    each rank can take; the few samples left go one at a time to the rank that would finish them
    first. Cost O(R log R) for R ranks.
    """
    if total < 0:
        raise HetrainError(f"global batch must be >= 0, got {total}")
    ranks = len(costs)
    if ranks == 0:
        raise HetrainError("cannot split a batch over zero ranks")
    for r, c in enumerate(costs):
        if not (c.per_sample > 0 and math.isfinite(c.per_sample)) or c.fixed < 0:
            raise HetrainError(f"rank {r}: per-sample time must be positive and finite, got {c.per_sample}")
    lo, hi = _bounds(total, ranks, min_share, max_share)
    per = np.array([c.per_sample for c in costs])
    fixed = np.array([c.fixed for c in costs])

    def capacity(t: float) -> np.ndarray:
        n = np.floor((t - fixed) / per + 1e-9)
        return np.clip(np.nan_to_num(n, nan=0.0, neginf=0.0), lo, hi).astype(np.int64)

    t_lo, t_hi = 0.0, float((fixed + hi * per).max())
    if capacity(t_lo).sum() >= total:
        shares = capacity(t_lo)
    else:
        for _ in range(100):
            mid = 0.5 * (t_lo + t_hi)
            if capacity(mid).sum() >= total:
                t_hi = mid
            else:
                t_lo = mid
            if t_hi - t_lo <= 1e-12 * max(1.0, t_hi):
                break
        shares = capacity(t_lo)
    shares = shares.tolist()
    left = total - sum(shares)
    heap = [(costs[r].time(shares[r] + 1), r) for r in range(ranks) if shares[r] < hi[r]]
    heapq.heapify(heap)
    while left > 0:
        _, r = heapq.heappop(heap)
        shares[r] += 1
        left -= 1
        if shares[r] < hi[r]:
            heapq.heappush(heap, (costs[r].time(shares[r] + 1), r))
    while left < 0:  # only when every capacity at t=0 already exceeds total (min shares)
        r = max((r for r in range(ranks) if shares[r] > lo[r]), key=lambda r: costs[r].time(shares[r]))
        shares[r] -= 1
        left += 1
    return [int(s) for s in shares]


def split_proportional(
    total: int,
    weights: Sequence[float],
    min_share: int | Sequence[int] | None = 0,
    max_share: int | Sequence[int] | None = None,
) -> list[int]:
    """Shares of ``total`` in proportion to ``weights`` (speeds), as integers, exactly summing up."""
    for r, w in enumerate(weights):
        if not (w > 0 and math.isfinite(w)):
            raise HetrainError(f"rank {r}: speed must be a positive number, got {w}; use a value like 1 or 0.5")
    return split_min_max(total, [RankCost(per_sample=1.0 / w) for w in weights], min_share, max_share)


def split_min_max_fn(
    total: int,
    time_fns: Sequence[Callable[[int], float]],
    min_share: int | Sequence[int] | None = 0,
    max_share: int | Sequence[int] | None = None,
) -> list[int]:
    """The same min-max split for any non-decreasing time functions (micro-batching, pipelines).

    Greedy from the minimum shares, one sample at a time to the rank that would finish it first;
    exact for non-decreasing functions, O(total log R).
    """
    ranks = len(time_fns)
    lo, hi = _bounds(total, ranks, min_share, max_share)
    shares = lo.tolist()
    heap = [(time_fns[r](shares[r] + 1), r) for r in range(ranks) if shares[r] < hi[r]]
    heapq.heapify(heap)
    for _ in range(total - sum(shares)):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        if shares[r] < hi[r]:
            heapq.heappush(heap, (time_fns[r](shares[r] + 1), r))
    return shares


def step_time(shares: Sequence[int], costs: Sequence[RankCost]) -> float:
    """The modelled time of one step: the slowest rank's."""
    return max(c.time(n) for n, c in zip(shares, costs))


def rebalance(
    current: Sequence[int],
    costs: Sequence[RankCost],
    *,
    min_share: int | Sequence[int] | None = 0,
    max_share: int | Sequence[int] | None = None,
    hysteresis: float = 0.05,
) -> tuple[list[int], float, float]:
    """The split to use next, with the modelled step times of the current and the next one.

    The current split is kept unless the best split is faster by more than ``hysteresis`` (a
    fraction), so measurement noise does not move samples back and forth every interval.
    """
    total = int(sum(current))
    best = split_min_max(total, costs, min_share, max_share)
    t_now, t_best = step_time(current, costs), step_time(best, costs)
    if t_best < t_now * (1.0 - hysteresis):
        return best, t_now, t_best
    return list(current), t_now, t_now


def split_partial(total: int, shares: Sequence[int]) -> list[int]:
    """Cut a smaller (last, partial) global batch in proportion to the current shares."""
    if total == sum(shares):
        return list(shares)
    weights = [max(s, 0) for s in shares]
    if sum(weights) == 0:
        weights = [1] * len(shares)
    # Ranks with share 0 stay at 0: give them an infinitesimal weight via an upper bound of 0.
    hi = [total if w > 0 else 0 for w in weights]
    return split_min_max(total, [RankCost(1.0 / w) if w > 0 else RankCost(1.0) for w in weights], 0, hi)
