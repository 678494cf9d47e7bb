"""Observe a run: Prometheus series per rank, the run log each rank appends, and `hetrain report`."""

from hetrain.metrics.rank_metrics import RankMetrics

__all__ = ["RankMetrics"]
