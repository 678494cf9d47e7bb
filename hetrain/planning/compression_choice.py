"""Which gradient compression a data-parallel candidate runs.

Unasked, the planner chooses among the compressions that keep the update one process's to the
precision sent (none, a 16-bit all-reduce), and only where the all-reduce across nodes is the
bottleneck (bound by the network, or by a node's own link where that is slower). PowerSGD, int8
and top-k send part of each gradient and carry the rest to later steps (error feedback): the update
differs from one process's, so they run only when asked for by name (`hetrain plan --compression
powersgd`); a note says what PowerSGD would gain where it would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hetrain.vocabulary import COMPRESSIONS

COMPRESSION_CHOICES = ("auto", *COMPRESSIONS)
COMM_BOUND_FRACTION = 0.05  # exposed network time above this share of a step makes the link the bottleneck
GOOD_ENOUGH = 0.95  # a less lossy hook wins when within this fraction of the best


def choose_compression(price: Callable[[str], Any], strategy: str, nodes: int, half: str, compression: str) -> Any:
    """The candidate of `strategy` priced by `price(hook)` under the compression asked for: `compression` by
    name, or with "auto" none or `half` (the 16-bit hook every device reduces in) as the network needs."""
    if compression != "auto":
        return price(compression)
    plain = price("none")
    if not plain.feasible or strategy == "zero3":
        return plain
    share = plain.inter_node_seconds / plain.step_seconds
    if share <= COMM_BOUND_FRACTION:
        if nodes > 1:
            plain.notes.append(f"{strategy}: network time not hidden under backward is {share:.1%} of a step; "
                               "no gradient compression needed")
        return plain
    tried = [plain, price(half)]
    best = max(c.samples_per_s for c in tried)
    chosen = next(c for c in tried if c.samples_per_s >= GOOD_ENOUGH * best)
    speeds = ", ".join(f"{c.compression} {c.samples_per_s:.0f}/s" for c in tried)
    chosen.notes.append(f"{strategy}: the all-reduce across nodes is the bottleneck (its exposed time {share:.0%} of a "
                        f"step without compression); predicted {speeds}; chose {chosen.compression}"
                        + (" (the least lossy within 5% of the best)" if chosen is plain else ""))
    lossy = price("powersgd")
    if lossy.feasible and lossy.samples_per_s * GOOD_ENOUGH > chosen.samples_per_s:
        chosen.notes.append(
            f"{strategy}: PowerSGD (rank 2) is predicted at {lossy.samples_per_s:.0f}/s "
            f"({lossy.samples_per_s / chosen.samples_per_s - 1:+.0%}), not chosen unasked: it sends a low-rank part of "
            "each gradient and carries the rest to later steps, so the update differs from one process's; "
            "--compression powersgd uses it")
    return chosen
