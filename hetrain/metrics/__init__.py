"""Observe a run: Prometheus series per rank, the run log each rank appends, and `hetrain report`.

`RankMetrics` is imported on first use, so the CLI's port checks (`hetrain.metrics.serve`) do not
import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetrain.metrics.rank_metrics import RankMetrics

__all__ = ["RankMetrics"]


def __getattr__(name: str) -> Any:
    if name == "RankMetrics":
        from hetrain.metrics.rank_metrics import RankMetrics

        return RankMetrics
    raise AttributeError(f"module 'hetrain.metrics' has no attribute {name!r}")
