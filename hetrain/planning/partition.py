"""How a model's layers are cut: contiguous blocks over pipeline stages, exact (min-max optimal).

(The global batch is cut by `hetrain.planning.batch_split.split_min_max`, the one split function.)
"""

from __future__ import annotations

from collections.abc import Callable

from hetrain.errors import HetrainError


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


def interleaved_stages(blocks_per_rank: list[int], chunks: int) -> list[tuple[int, int]]:
    """The stages of an interleaved pipeline: each rank's blocks cut into `chunks` near-equal chunks,
    laid out in pipeline order (chunk c of the rank at position j is stage c * p + j), so the
    blocks of a rank's chunks add up to its share of the partition.

    [6, 3, 3] blocks in 3 chunks: stages of 2, 1, 1 blocks, three times over.
    """
    if chunks < 1 or any(n < chunks for n in blocks_per_rank):
        raise HetrainError(f"cannot cut ranks holding {blocks_per_rank} blocks into {chunks} chunks each; "
                           f"every rank needs at least {chunks} blocks (use fewer chunks)")
    sizes = [[n // chunks + (1 if c < n % chunks else 0) for c in range(chunks)] for n in blocks_per_rank]
    bounds, start = [], 0
    for c in range(chunks):
        for per_rank in sizes:
            bounds.append((start, start + per_rank[c]))
            start += per_rank[c]
    return bounds
