"""How a global batch is cut into integer per-rank shares.

One function, `split_min_max`, serves the planner (before the job, over device kinds) and the
balancer (while it runs, over ranks), so plan time and run time cannot disagree. A device's step
time is a non-decreasing function of its share: affine, ``fixed + n * per_sample`` (`RankCost`),
as the balancer measures it, or any function (`FunctionCost`: micro-batching, pipeline stages),
as the planner models it. The split minimises the slowest device's time exactly over integer
shares within per-device bounds.
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
    """A rank's step time as a function of its share: ``fixed + n * per_sample`` seconds. At 0 samples a rank
    still runs its step's fixed part (its optimizer step, the backward of exact zeros that joins the gradient
    all-reduce): ``idle``, what it measured there, or else ``fixed``."""

    per_sample: float
    fixed: float = 0.0
    idle: float | None = None

    def time(self, n: int) -> float:
        if n > 0:
            return self.fixed + n * self.per_sample
        return self.fixed if self.idle is None else self.idle


def _bounds(total: int, costs: Sequence[Cost], counts: Sequence[int], min_share, max_share
            ) -> tuple[list[int], list[int]]:
    ranks = len(costs)
    lo = np.broadcast_to(np.asarray(min_share if min_share is not None else 0, dtype=np.int64), (ranks,)).copy()
    if max_share is None:
        hi = np.full(ranks, total, dtype=np.int64)
    else:
        hi = np.broadcast_to(np.asarray(max_share, dtype=np.int64), (ranks,)).copy()
    hi = np.minimum(hi, total)
    n = np.asarray(counts, dtype=np.int64)
    if (lo < 0).any():
        raise HetrainError(f"min_share must be >= 0, got {lo.tolist()}")
    if (hi < lo).any():
        raise HetrainError(f"max_share {hi.tolist()} is below min_share {lo.tolist()} for some rank")
    if int((lo * n).sum()) > total:
        raise HetrainError(
            f"global batch {total} is smaller than the minimum shares add up to ({int((lo * n).sum())} over "
            f"{int(n.sum())} ranks); raise the global batch size to at least {int((lo * n).sum())} or lower min_share"
        )
    if int((hi * n).sum()) < total:
        raise HetrainError(
            f"global batch {total} does not fit: the devices take at most {int((hi * n).sum())} samples together "
            f"(max_share {hi.tolist()}); lower the global batch, add devices, or use gradient accumulation"
        )
    return lo.tolist(), hi.tolist()


@dataclass(frozen=True)
class FunctionCost:
    """A step time given as any non-decreasing function of the share >= 0 (micro-batching, pipelines);
    a device given no samples may still take time (its optimizer step)."""

    fn: Callable[[int], float]

    def time(self, n: int) -> float:
        return self.fn(max(n, 0))


Cost = RankCost | FunctionCost


def _capacity(cost: Cost, t: float, lo: int, hi: int) -> int:
    """The largest share in [lo, hi] whose time is <= t (lo when even lo takes longer)."""
    if isinstance(cost, RankCost):
        n = math.floor((t - cost.fixed) / cost.per_sample + 1e-9) if t >= cost.fixed else 0
        return int(min(max(n, lo), hi))
    a, b = lo, hi
    while a < b:
        mid = (a + b + 1) // 2
        if cost.time(mid) <= t:
            a = mid
        else:
            b = mid - 1
    return a


def split_min_max(
    total: int,
    costs: Sequence[Cost],
    min_share: int | Sequence[int] | None = 0,
    max_share: int | Sequence[int] | None = None,
    counts: Sequence[int] | None = None,
) -> list[int]:
    """Integer shares summing to ``total`` that minimise the slowest device's time: THE split of
    hetrain, used by the planner (before the job) and the balancer (while it runs).

    ``costs[k]`` is the step time of device (or device kind) k as a function of its share; with
    ``counts``, k stands for ``counts[k]`` identical devices and the result lists every device
    (kind by kind). Exact for non-decreasing costs: bisection on the step time finds, for a time
    just below the optimum, how many samples each device can take; the few samples left go one
    at a time to the device that would finish them first (identical devices move together). A device
    whose step takes longer at 0 samples than at 1 (an idle rank's backward of exact zeros can cost more
    than one sample's) keeps at least one where the batch has one for it: a sample moved to it from any
    other device shortens its step and lengthens none, so the costs are non-decreasing from there.
    """
    if total < 0:
        raise HetrainError(f"global batch must be >= 0, got {total}")
    counts = [1] * len(costs) if counts is None else [int(c) for c in counts]
    if len(counts) != len(costs):
        raise HetrainError(f"{len(counts)} device counts for {len(costs)} costs; give one count per cost")
    if not costs or sum(counts) == 0:
        raise HetrainError("cannot split a batch over zero devices; add devices")
    for r, c in enumerate(costs):
        if isinstance(c, RankCost) and (not (c.per_sample > 0 and math.isfinite(c.per_sample)) or c.fixed < 0):
            raise HetrainError(f"rank {r}: per-sample time must be positive and finite, got {c.per_sample}")
        if isinstance(c, RankCost) and c.idle is not None and not (c.idle >= 0 and math.isfinite(c.idle)):
            raise HetrainError(f"rank {r}: the time at 0 samples must be >= 0 and finite, got {c.idle}")
    lo, hi = _bounds(total, costs, counts, min_share, max_share)
    caps = lambda t: [_capacity(c, t, int(l), int(h)) for c, l, h in zip(costs, lo, hi)]  # noqa: E731
    taken = lambda shares: sum(n * s for n, s in zip(counts, shares))  # noqa: E731
    for k in sorted(range(len(costs)), key=lambda k: -costs[k].time(0)):   # too few samples for all: the longest first
        slower_idle = costs[k].time(0) > costs[k].time(1)
        if lo[k] == 0 and hi[k] >= 1 and counts[k] and slower_idle and taken(lo) + counts[k] <= total:
            lo[k] = 1
    t_lo, t_hi = 0.0, max(c.time(int(h)) for c, h, n in zip(costs, hi, counts) if n)
    if taken(caps(t_lo)) < total:
        for _ in range(200):
            if t_hi - t_lo <= 1e-12 * max(1.0, t_hi):
                break
            mid = 0.5 * (t_lo + t_hi)
            if taken(caps(mid)) >= total:
                t_hi = mid
            else:
                t_lo = mid
    base = caps(t_lo)
    left = total - taken(base)
    # level[k] maps share -> how many devices of cost k are at that share
    level = [{b: n} for b, n in zip(base, counts)]
    heap = [(c.time(b + 1), k, b) for k, (c, b, h, n) in enumerate(zip(costs, base, hi, counts)) if n and b < h]
    heapq.heapify(heap)
    while left > 0:
        _, k, n = heapq.heappop(heap)
        moved = min(left, level[k][n])
        level[k][n] -= moved
        level[k][n + 1] = level[k].get(n + 1, 0) + moved
        left -= moved
        if level[k][n] > 0:  # the devices not moved stay eligible at this level
            heapq.heappush(heap, (costs[k].time(n + 1), k, n))
        if n + 1 < hi[k]:
            heapq.heappush(heap, (costs[k].time(n + 2), k, n + 1))
    while left < 0:  # only when the minimum shares alone exceed what bisection started from
        k = max((k for k in range(len(costs)) if any(v for s, v in level[k].items() if s > lo[k])),
                key=lambda k: costs[k].time(max(s for s, v in level[k].items() if v)))
        top = max(s for s, v in level[k].items() if v)
        level[k][top] -= 1
        level[k][top - 1] = level[k].get(top - 1, 0) + 1
        left += 1
    out: list[int] = []
    for lv in level:
        for n in sorted(lv, reverse=True):
            out += [int(n)] * lv[n]
    return out


def split_even(total: int, parts: int) -> list[int]:
    """`total` in `parts` nearly equal shares, the remainder to the first (as plain DDP splits a batch)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


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
    fraction), so measurement noise does not move samples back and forth every interval. Even at
    hysteresis 0 a split that only ties the current one (within float rounding) is not taken.
    """
    total = int(sum(current))
    best = split_min_max(total, costs, min_share, max_share)
    t_now, t_best = step_time(current, costs), step_time(best, costs)
    if t_best < t_now * (1.0 - max(hysteresis, 1e-9)):
        return best, t_now, t_best
    return list(current), t_now, t_now


def split_partial(total: int, shares: Sequence[int]) -> list[int]:
    """Cut a smaller (last, partial) global batch in proportion to the current shares. A rank with a
    share keeps at least one sample where the batch has one for each such rank (a model need not
    take an empty batch: a last batch of 8 at shares 15/1 is 7/1, not 8/0)."""
    if total == sum(shares):
        return list(shares)
    weights = [max(s, 0) for s in shares]
    if sum(weights) == 0:
        weights = [1] * len(shares)
    # Ranks with share 0 stay at 0: give them an infinitesimal weight via an upper bound of 0.
    hi = [total if w > 0 else 0 for w in weights]
    lo = [1 if w > 0 else 0 for w in weights] if total >= sum(w > 0 for w in weights) else 0
    return split_min_max(total, [RankCost(1.0 / w) if w > 0 else RankCost(1.0) for w in weights], lo, hi)
