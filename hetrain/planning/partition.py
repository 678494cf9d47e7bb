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
    min_size: int = 1,
) -> tuple[list[tuple[int, int]], float] | None:
    """Contiguous [a, b) block ranges, one per stage in order, minimising the slowest stage.

    Dynamic programming over (stage, first block of the next stage): exact, O(p * L^2) for p
    stages and L blocks at most. `stage_time(j, a, b)` and `fits(j, a, b)` describe stage j holding
    blocks a..b-1; every stage holds at least `min_size` blocks. None when no partition fits.

    Both are taken to be monotone in the range, as time and memory are: a stage that holds more
    blocks takes no less time, and does not fit where a stage holding fewer does not. So the
    ranges that end at b are tried growing, and the search stops at the first that does not fit or
    that alone is slower than the best found (among equal partitions it keeps the one the whole
    search keeps).
    """
    min_size = max(1, min_size)
    if n_stages < 1 or n_stages * min_size > n_blocks:
        return None
    inf = float("inf")
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[-1] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, n_stages + 1):
        for b in range(j * min_size, n_blocks - (n_stages - j) * min_size + 1):
            for a in range(b - min_size, (j - 1) * min_size - 1, -1):
                prev = best[j - 1][a]
                if prev == inf:
                    continue
                if not fits(j - 1, a, b):
                    break   # nor does any longer range
                own = stage_time(j - 1, a, b)
                if own > best[j][b]:
                    break   # longer ranges take longer still
                t = max(prev, own)
                if t <= best[j][b]:
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


def _kept(samples: int, m: int, interleaved_ranks: int | None) -> bool:
    """Whether the runtime runs `m` micro-batches of `samples` as they are: m divides the batch (one shape)
    and, over interleaved ranks, is a multiple of its rounds."""
    return samples % m == 0 and not (interleaved_ranks and m % max(1, m // interleaved_ranks))


def microbatches_for(samples: int, planned: int, interleaved_ranks: int | None = None) -> int:
    """Micro-batches for a replica batch of `samples`: the plan's count, lowered to a divisor of the
    batch so every micro-batch has one shape (pipeline stages exchange fixed-shape tensors). Over
    `interleaved_ranks` ranks, also a multiple of its rounds (m // ranks), as torch's interleaved
    1F1B requires. What the runtime runs."""
    m = max(1, min(planned, samples))
    while not _kept(samples, m, interleaved_ranks):
        m -= 1
    return m


def microbatches_at_most(samples: int, micro_batch: int, interleaved_ranks: int | None = None) -> int:
    """The fewest micro-batches the runtime keeps as they are (`microbatches_for`) whose size is at most
    `micro_batch` (else the most it keeps): a plan's count that the runtime does not lower, so its
    micro-batch is the one priced."""
    samples = max(1, samples)
    m = max(1, -(-samples // max(1, micro_batch)))
    while m <= samples and not _kept(samples, m, interleaved_ranks):
        m += 1
    return m if m <= samples else microbatches_for(samples, samples, interleaved_ranks)
