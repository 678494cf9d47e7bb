"""Renders a rank's state into Prometheus metric families when scraped (prometheus_client's thread).

A series appears only once its figure exists: no loss before the first step, no gradient norm
until `clip_grad_norm_`, no MFU without a model cost and a device peak, no NVML reading a device
lacks. Nothing here runs on the training step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric,
                                    SummaryMetricFamily)
from prometheus_client.registry import Collector

from hetrain.metrics.names import BY_NAME, family_name
from hetrain.metrics.state import RankState


class RankCollector(Collector):
    """Yields every hetrain_* family of one rank from a snapshot of its state."""

    def __init__(self, state: RankState, lock: threading.Lock, labels: dict[str, str], *,
                 world_size: int, predicted_step_seconds: float | None, peak_flops: Callable[[], float | None],
                 memory: Callable[[], dict[str, float]], gpu: Callable[[], dict[str, float]] | None = None,
                 info: dict[str, str] | None = None) -> None:
        self.state, self.lock = state, lock
        self.label_names = list(labels)
        self.label_values = list(labels.values())
        self.world_size = world_size
        self.predicted = predicted_step_seconds
        self.peak_flops = peak_flops
        self.memory = memory
        self.gpu = gpu
        self.info = info or {}   # more of hetrain_rank_info's labels (a pipeline rank's stage and replica)

    def _family(self, name: str, extra: tuple[str, ...] = ()) -> Metric:
        m = BY_NAME[name]
        cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "summary": SummaryMetricFamily}[m.kind]
        return cls(family_name(m), m.help, labels=self.label_names + list(extra))

    def _one(self, name: str, value: float | None) -> Iterator[Metric]:
        if value is None:
            return
        f = self._family(name)
        f.add_metric(self.label_values, value)
        yield f

    def _by(self, name: str, extra: str, values: dict[str, float]) -> Iterator[Metric]:
        if not values:
            return
        f = self._family(name, (extra,))
        for key, value in sorted(values.items()):
            f.add_metric(self.label_values + [key], value)
        yield f

    def _summary(self, name: str, count: int, total: float) -> Iterator[Metric]:
        f = self._family(name)
        f.add_metric(self.label_values, count_value=count, sum_value=total)
        yield f

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            s = self.state.copy()
        info = InfoMetricFamily(family_name(BY_NAME["hetrain_rank_info"]), BY_NAME["hetrain_rank_info"].help,
                                labels=self.label_names)
        info.add_metric(self.label_values, {"precision": s.precision or "", "world_size": str(self.world_size),
                                            "emulated": str(s.emulated).lower(), **self.info})
        yield info
        yield from self._one("hetrain_predicted_step_seconds", self.predicted)
        yield from self._by("hetrain_memory_bytes", "kind", self.memory())
        if self.gpu is not None:
            for name, value in self.gpu().items():
                yield from self._one(name, value)
        yield from self._one("hetrain_restarts_total", float(s.restarts))
        if s.steps:
            yield from self._steps(s)
        if s.checkpoints:
            yield from self._summary("hetrain_checkpoint_blocking_seconds", s.checkpoints, s.checkpoint_blocking_seconds)
            yield from self._summary("hetrain_checkpoint_save_seconds", s.checkpoints, s.checkpoint_save_seconds)
            yield from self._one("hetrain_checkpoints_written_total", float(s.checkpoints))
            yield from self._one("hetrain_checkpoint_bytes", s.checkpoint_bytes)

    def _steps(self, s: RankState) -> Iterator[Metric]:
        yield from self._one("hetrain_step", s.step)
        yield from self._one("hetrain_steps_total", float(s.steps))
        yield from self._summary("hetrain_step_seconds", s.timed_steps, s.step_seconds)
        yield from self._one("hetrain_compute_seconds_total", s.compute_seconds)
        yield from self._by("hetrain_wait_seconds_total", "cause", s.wait_seconds)
        yield from self._one("hetrain_script_seconds_total", s.script_seconds)
        yield from self._one("hetrain_samples_total", float(s.samples))
        yield from self._one("hetrain_items_total", float(s.items))
        yield from self._one("hetrain_share_samples", s.share)
        yield from self._one("hetrain_share_ratio", s.share_ratio)
        yield from self._one("hetrain_split_changes_total", float(s.split_changes))
        yield from self._by("hetrain_comm_sent_bytes_total", "level", s.comm_bytes)
        yield from self._one("hetrain_loss", s.loss)
        yield from self._one("hetrain_grad_norm", s.grad_norm)
        yield from self._one("hetrain_loss_scale", s.loss_scale)
        yield from self._one("hetrain_skipped_steps_total", float(s.skipped_steps))
        if s.mfu is not None:
            yield from self._one("hetrain_mfu_ratio", s.mfu)
            yield from self._one("hetrain_peak_flops", self.peak_flops())
