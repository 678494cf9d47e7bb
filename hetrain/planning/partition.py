"""How work is cut: the global batch over kinds of identical devices, and contiguous blocks of
layers over pipeline stages. Both are exact (min-max optimal), not heuristics.

Devices of one kind behave alike, so the batch split searches over kinds, not ranks: every
device of a kind gets the same share, give or take one sample. The result is the same min-max
optimum that `hetrain.planning.batch_split.split_min_max_fn` finds rank by rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetrain.errors import HetrainError


@dataclass(frozen=True)
class KindLoad:
    """`count` identical devices whose step time for a share n is `time(n)` (non-decreasing)."""

    count: int
    time: Callable[[int], float]
    max_share: int | None = None


def _capacity(load: KindLoad, limit: float, hi: int) -> int:
    """Largest share n in [0, hi] with time(n) <= limit."""
    lo_n, hi_n = 0, hi
    while lo_n < hi_n:
        mid = (lo_n + hi_n + 1) // 2
        if load.time(mid) <= limit:
            lo_n = mid
        else:
            hi_n = mid - 1
    return lo_n


def split_by_kind(total: int, loads: Sequence[KindLoad]) -> list[list[int]]:
    """Per kind, the shares of its devices (same share +-1) minimising the slowest device's time.

    Bisection on the step time finds the largest time at which the kinds cannot yet take the whole
    batch; the samples left then go, level by level, to whichever devices finish their next sample
    first. Cost O(K log(total) log(1/eps)) time evaluations for K kinds.
    """
    if total < 0:
        raise HetrainError(f"global batch must be >= 0, got {total}")
    if not loads or sum(ld.count for ld in loads) == 0:
        raise HetrainError("cannot split a batch over a cluster with no devices; add devices to the cluster")
    his = [min(total, ld.max_share) if ld.max_share is not None else total for ld in loads]
    if sum(ld.count * h for ld, h in zip(loads, his)) < total:
        raise HetrainError(
            f"global batch {total} does not fit: the devices take at most "
            f"{sum(ld.count * h for ld, h in zip(loads, his))} samples together; lower the global batch or add devices"
        )
    t_lo, t_hi = 0.0, max(ld.time(h) for ld, h in zip(loads, his) if ld.count)
    for _ in range(200):
        if t_hi - t_lo <= 1e-12 * max(t_hi, 1e-30):
            break
        mid = 0.5 * (t_lo + t_hi)
        if sum(ld.count * _capacity(ld, mid, h) for ld, h in zip(loads, his)) >= total:
            t_hi = mid
        else:
            t_lo = mid
    base = [_capacity(ld, t_lo, h) if ld.count else 0 for ld, h in zip(loads, his)]
    left = total - sum(ld.count * b for ld, b in zip(loads, base))
    # level[k] maps share -> number of devices of kind k at that share
    level = [{b: ld.count} for ld, b in zip(loads, base)]
    heap = [(ld.time(b + 1), k, b) for k, (ld, b, h) in enumerate(zip(loads, base, his)) if ld.count and b < h]
    heapq.heapify(heap)
    while left > 0:
        _, k, n = heapq.heappop(heap)
        moved = min(left, level[k][n])
        level[k][n] -= moved
        level[k][n + 1] = level[k].get(n + 1, 0) + moved
        left -= moved
        if level[k][n] > 0:  # the ones not moved stay eligible at this level
            heapq.heappush(heap, (loads[k].time(n + 1), k, n))
        if n + 1 < his[k]:
            heapq.heappush(heap, (loads[k].time(n + 2), k, n + 1))
    out = []
    for lv in level:
        shares: list[int] = []
        for n in sorted(lv, reverse=True):
            shares += [n] * lv[n]
        out.append(shares)
    return out


def partition_blocks(
    n_blocks: int,
    n_stages: int,
    stage_time: Callable[[int, int, int], float],
    fits: Callable[[int, int, int], bool] = lambda j, a, b: True,
) -> tuple[list[tuple[int, int]], float] | None:
    """Contiguous [a, b) block ranges, one per stage in order, minimising the slowest stage.

    Dynamic programming over (stage, first block of the next stage): exact, O(p * L^2) for p
    stages and L blocks. `stage_time(j, a, b)` and `fits(j, a, b)` describe stage j holding
    blocks a..b-1. None when no partition fits.
    """
    if n_stages < 1 or n_stages > n_blocks:
        return None
    inf = float("inf")
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[-1] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, n_stages + 1):
        for b in range(j, n_blocks - (n_stages - j) + 1):
            for a in range(j - 1, b):
                prev = best[j - 1][a]
                if prev == inf or not fits(j - 1, a, b):
                    continue
                t = max(prev, stage_time(j - 1, a, b))
                if t < best[j][b]:
                    best[j][b], cut[j][b] = t, a
    if best[n_stages][n_blocks] == inf:
        return None
    bounds, b = [], n_blocks
    for j in range(n_stages, 0, -1):
        a = cut[j][b]
        bounds.append((a, b))
        b = a
    return bounds[::-1], best[n_stages][n_blocks]
