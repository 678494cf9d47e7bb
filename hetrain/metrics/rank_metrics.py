"""The one observer a Session creates per rank: Prometheus series on PORT + local_rank and the run log.

The Session calls `on_step` after every step, `on_checkpoint` after every checkpoint, `on_restart`
once when the elastic agent restarted the workers, and `close` at the end. A step only updates
numbers in memory and appends one buffered line; Prometheus reads the numbers on its own thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref
from pathlib import Path
from types import ModuleType

import torch
from prometheus_client.registry import CollectorRegistry

from hetrain.exiting import once_at_exit
from hetrain.metrics.collector import RankCollector
from hetrain.metrics.memory import rank_memory
from hetrain.metrics.mfu import catalog_peak_flops, mfu
from hetrain.metrics.nvml import NvmlDevice, load_nvml
from hetrain.metrics.run_log import RunLog
from hetrain.metrics.serve import serve
from hetrain.metrics.state import RankState
from hetrain.metrics.events import CheckpointRecord, StepRecord

log = logging.getLogger(__name__)


_LOGGING: "weakref.WeakSet[RankMetrics]" = weakref.WeakSet()


def begin_logs() -> None:
    """At exit: the start line (and a restart held for after it) of every run log not yet begun, so that an
    attempt that failed before its first step (a restart that failed again) is in the log."""
    for metrics in list(_LOGGING):   # only those with a run log are in it
        metrics._begin_log()



class RankMetrics:
    """This rank's metrics.

    `port` is the node's BASE port (`--metrics-port`, HETRAIN_METRICS_PORT): this rank serves
    `/metrics` on port + local_rank; None serves nothing. `run_dir`: where the run log
    (run_dir/metrics/rank-N.jsonl) goes; None writes none. `peak_flops` defaults to the catalog's
    figure for `device_name` in the step's precision, and to none on a CPU rank (one emulating a
    plan's GPU computes at a CPU's rate, which that GPU's peak does not describe). `nvml`: an NVML module to use instead of
    `pynvml` (tests pass a fake). `precision` and `emulated` label `hetrain_rank_info` before the first step;
    `place`, a pipeline rank's stage and replica (stage, stages, replica, replicas), labels it and the run log's start.
    """

    def __init__(self, *, rank: int, local_rank: int, world_size: int, device: torch.device, device_name: str,
                 port: int | None, run_dir: str | Path | None, job: str,
                 predicted_step_seconds: float | None = None, peak_flops: float | None = None,
                 flops_per_item: float | None = None, nvml: ModuleType | None = None, precision: str | None = None,
                 emulated: bool = False, place: dict[str, int] | None = None) -> None:
        self.rank, self.device, self.device_name = rank, torch.device(device), device_name
        self.flops_per_item = flops_per_item
        self._peak: float | None = peak_flops
        self._peak_resolved = peak_flops is not None
        self._lock = threading.Lock()
        self.state = RankState(precision=precision, emulated=emulated)   # in rank_info from the first scrape
        node = socket.gethostname()
        labels = {"job": job, "rank": str(rank), "node": node, "device": device_name}
        gpu = self._open_gpu(nvml, labels, node) if self.device.type == "cuda" else None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RankCollector(
            self.state, self._lock, labels, world_size=world_size, predicted_step_seconds=predicted_step_seconds,
            peak_flops=lambda: self._peak, memory=lambda: rank_memory(self.device),
            gpu=gpu.sample if gpu is not None else None, info={k: str(v) for k, v in (place or {}).items()}))
        # the run log's start line waits for the first record: by then the peak (which needs the step's
        # precision) and the model's FLOPs per item (counted over the first forward) are known
        self._start: dict | None = {**labels, "rank": rank, "local_rank": local_rank, "world_size": world_size,
                                    "predicted_step_seconds": predicted_step_seconds, **(place or {})}
        self._held: list[dict] = []   # lines that come before the first step (a restart), after the start line
        self._log = RunLog(run_dir, rank) if run_dir is not None else None
        if self._log is not None:   # a rank that fails before its first step still logs its start (and restart)
            _LOGGING.add(self)
            once_at_exit(begin_logs)
        self._server = None
        self.port = None if port is None else port + local_rank
        if port is not None:
            try:
                self._server = serve(self.registry, port, local_rank)
            except BaseException:
                self.close()
                raise

    def _open_gpu(self, nvml: ModuleType | None, labels: dict[str, str], node: str) -> NvmlDevice | None:
        nvml = nvml or load_nvml()
        if nvml is None:
            return None
        try:
            gpu = NvmlDevice.by_uuid(nvml, str(torch.cuda.get_device_properties(self.device).uuid))
        except Exception as e:  # no metrics is better than a failed run
            log.warning("no NVML readings for %s: %s", self.device, e)
            return None
        labels.update({"UUID": gpu.uuid, "gpu": str(gpu.index), "Hostname": node})
        return gpu

    def on_step(self, record: StepRecord) -> None:
        if not self._peak_resolved:   # a CPU rank has none, a CPU rank standing in for a plan's GPU included
            self._peak = catalog_peak_flops(self.device_name, record.precision) if self.device.type != "cpu" else None
            self._peak_resolved = True
        if record.model_flops is not None:   # counted by the session: the step's own FLOPs
            value = mfu(record.model_flops, 1, record.step_seconds, self._peak)
        else:
            value = mfu(self.flops_per_item, record.items, record.step_seconds, self._peak)
        with self._lock:
            self.state.add_step(record, value)
        if self._log is not None:
            per_item = None
            if self.flops_per_item is None and record.model_flops is not None and record.items:
                per_item = record.model_flops / record.items   # this step's FLOPs per item, as MFU used
            self._begin_log(per_item)
            self._log.step(record, mfu=value)

    def _begin_log(self, flops_per_item: float | None = None) -> None:
        """Once: write the start line (with the peak and the FLOPs per item) and the lines held for after it."""
        if self._start is None:
            return
        self._log.write({"kind": "start", **self._start, "peak_flops": self._peak,
                         "flops_per_item": self.flops_per_item if flops_per_item is None else flops_per_item})
        self._start = None
        for line in self._held:
            self._log.write(line)
        self._held = []

    def on_checkpoint(self, record: CheckpointRecord) -> None:
        with self._lock:
            self.state.add_checkpoint(record)
        if self._log is not None:
            self._begin_log()
            self._log.checkpoint(record)

    def on_restart(self, count: int) -> None:
        """The elastic agent's restart count for this attempt (TORCHELASTIC_RESTART_COUNT)."""
        with self._lock:
            self.state.restarts = count
        if self._log is not None:
            line = {"kind": "restart", "count": count}
            if self._start is not None:
                self._held.append(line)
            else:
                self._log.write(line)

    def close(self) -> None:
        """Stop serving and close the run log (its start line written, steps or none); safe to call twice."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._log is not None:
            self._begin_log()
            self._log.close()
