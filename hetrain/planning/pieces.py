"""The micro-batch count of a ZeRO-3 (FSDP2) job, chosen with its split.

FSDP2 gathers and reduce-scatters once per micro-batch, so every rank runs as many micro-batches as
the rank that needs the most: the count and the split decide each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hetrain.planning.batch_split import FunctionCost, split_min_max
from hetrain.planning.kinds import Kind


def fsdp_pieces(kinds: list[Kind], global_batch: int, choices: list[tuple[int, bool]],
                 per_rank: dict[int, tuple[int, int, bool]],
                 step_of: Callable[[dict[int, tuple[int, int, bool]], int], float]) -> int:
    """The micro-batch count every rank of a ZeRO-3 job runs (FSDP2's gathers and reduce-scatters run once
    per micro-batch, so all ranks run the most any share needs), and `per_rank` re-split, in place, for it.

    Each count P from the fewest that holds the global batch is weighed: shares split min-max at P pieces
    each (at most P micro-batches of a kind's size), priced whole by `step_of(split, P)` (compute and the
    P rounds of gathers); the fastest wins. Giving a slow device no samples can force every rank through
    many small pieces, each gathering the model: an even split at fewer pieces was 6.4x faster there."""
    counts = [k.count for k in kinds]

    def split_at(pieces: int) -> dict[int, tuple[int, int, bool]]:
        costs = [FunctionCost(lambda n, k=k, c=c, p=pieces: k.pieces_time(n, p, c))
                 for k, (_, c) in zip(kinds, choices)]
        shares = iter(split_min_max(global_batch, costs, max_share=[pieces * mb for mb, _ in choices], counts=counts))
        return {r: (next(shares), mb, c) for k, (mb, c) in zip(kinds, choices) for r in k.ranks}

    fewest = max(1, math.ceil(global_batch / sum(n * mb for n, (mb, _) in zip(counts, choices))))
    most = max((math.ceil(share / mb) for share, mb, _ in per_rank.values() if share), default=1)
    most = max(most, fewest)
    tried = set(range(fewest, min(most, fewest + 32) + 1))
    p = fewest
    while p < most:   # beyond the first 32 counts, every tenth more
        p = max(p + 1, math.ceil(p * 1.1))
        tried.add(min(p, most))
    best = min((step_of(split, p), p, split) for p in sorted(tried) for split in [split_at(p)])
    per_rank.update(best[2])
    return best[1]
