"""Every series hetrain exports, written once: the exporter, the dashboard, the docs and the tests read it.

Prometheus conventions: the `hetrain_` prefix, base units in the name (`_seconds`, `_bytes`,
`_ratio`, `_watts`, `_celsius`), `_total` on counters. Each series carries the rank's labels
(`RANK_LABELS`, plus `CUDA_LABELS` on a CUDA rank) and any extra label listed with it.
"""

from __future__ import annotations

from dataclasses import dataclass

RANK_LABELS = ("job", "rank", "node", "device")
"""On every series: the run id, the global rank, the host, the device's catalog name ('cpu' on a CPU rank)."""

CUDA_LABELS = ("UUID", "gpu", "Hostname")
"""On a CUDA rank only, spelled as DCGM exporter spells them, so `on(UUID)` joins its series."""


@dataclass(frozen=True)
class Metric:
    name: str          # the exposed name (a counter's includes `_total`)
    kind: str          # gauge, counter, summary, info
    help: str
    labels: tuple[str, ...] = ()   # labels beyond the rank's own
    source: str = "step"           # when it appears: step, clip, checkpoint, restart, start, memory, nvml, nvlink, mfu, plan


METRICS: tuple[Metric, ...] = (
    Metric("hetrain_rank_info", "info", "One series per rank carrying its labels, the precision and world size "
           "(and a pipeline rank's stage and replica).",
           ("precision", "world_size", "emulated"), source="start"),   # a pipeline rank's add stage(s), replica(s)
    Metric("hetrain_step", "gauge", "Steps completed, resumed steps included."),
    Metric("hetrain_steps_total", "counter", "Steps this process ran."),
    Metric("hetrain_step_seconds", "summary",
           "Wall time of a step, from the previous step's end (all steps but a process's first)."),
    Metric("hetrain_compute_seconds_total", "counter", "Forward, backward and optimizer time of timed steps."),
    Metric("hetrain_wait_seconds_total", "counter",
           "Time of timed steps not computing, by cause: 'ranks' (the rest of the step: waiting on other ranks "
           "and the gradient communication backward did not hide), 'data' (for the batch) or 'checkpoint' (the "
           "checkpoint service after the optimizer: saves, and reporting committed ones).",
           ("cause",)),
    Metric("hetrain_script_seconds_total", "counter",
           "Time of timed steps the training script spent in its own code between steps (logging, evaluation): "
           "from step() returning to the next forward, less the wait for data."),
    Metric("hetrain_samples_total", "counter", "Samples this rank computed."),
    Metric("hetrain_items_total", "counter", "Items (tokens, or samples) this rank computed."),
    Metric("hetrain_share_samples", "gauge", "Samples of a full global batch this rank takes under the current split."),
    Metric("hetrain_share_ratio", "gauge", "This rank's share of the global batch (0-1)."),
    Metric("hetrain_split_changes_total", "counter", "Times the balancer changed the split."),
    Metric("hetrain_comm_sent_bytes_total", "counter", "Bytes this rank sent for gradient communication, by level.",
           ("level",)),
    Metric("hetrain_loss", "gauge", "Global item-weighted mean loss of the last step."),
    Metric("hetrain_grad_norm", "gauge", "Total gradient norm at the last clip_grad_norm_.", source="clip"),
    Metric("hetrain_loss_scale", "gauge", "Loss scale (1 without fp16 scaling)."),
    Metric("hetrain_skipped_steps_total", "counter", "Updates skipped for a non-finite gradient (all ranks agree)."),
    Metric("hetrain_memory_bytes", "gauge",
           "Memory of this rank by kind: CUDA allocator 'allocated', 'reserved', 'peak_allocated', 'peak_reserved'; "
           "on a CPU rank the process's 'rss' and 'peak_rss'.", ("kind",), source="memory"),
    Metric("hetrain_predicted_step_seconds", "gauge",
           "The plan's predicted step time for this rank at the plan's split (not updated after a re-split).",
           source="plan"),
    Metric("hetrain_mfu_ratio", "gauge",
           "Model FLOPs of the last step over its wall time and this device's peak in its precision.", source="mfu"),
    Metric("hetrain_peak_flops", "gauge", "The peak FLOP/s MFU is measured against (datasheet, dense).", source="mfu"),
    Metric("hetrain_checkpoint_blocking_seconds", "summary",
           "The time a save held the loop: capturing the state, the wait for the previous save, the copy or write.",
           source="checkpoint"),
    Metric("hetrain_checkpoint_save_seconds", "summary", "Time until a checkpoint was committed on disk.",
           source="checkpoint"),
    Metric("hetrain_checkpoints_written_total", "counter", "Checkpoints written.", source="checkpoint"),
    Metric("hetrain_checkpoint_bytes", "gauge", "Size of the last checkpoint written.", source="checkpoint"),
    Metric("hetrain_restarts_total", "counter", "Times the elastic agent restarted this job's workers.",
           source="restart"),
    Metric("hetrain_gpu_utilization_ratio", "gauge",
           "Fraction of the last sample period in which a kernel ran on the GPU (NVML utilization.gpu).", source="nvml"),
    Metric("hetrain_gpu_memory_used_bytes", "gauge", "Device memory in use by all processes (NVML).", source="nvml"),
    Metric("hetrain_gpu_power_watts", "gauge", "Board power draw (NVML).", source="nvml"),
    Metric("hetrain_gpu_temperature_celsius", "gauge", "GPU die temperature (NVML).", source="nvml"),
    Metric("hetrain_gpu_nvlink_sent_bytes_total", "counter", "Data bytes sent over all NVLinks (NVML).",
           source="nvlink"),
    Metric("hetrain_gpu_nvlink_received_bytes_total", "counter", "Data bytes received over all NVLinks (NVML).",
           source="nvlink"),
)

BY_NAME = {m.name: m for m in METRICS}


def family_name(metric: Metric) -> str:
    """The name prometheus_client's metric families take: without `_total` or `_info`."""
    for suffix in ("_total", "_info"):
        if metric.name.endswith(suffix):
            return metric.name[: -len(suffix)]
    return metric.name
