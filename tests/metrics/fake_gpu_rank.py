"""A CUDA rank on a machine without one: RankMetrics on 'cuda:0' with torch.cuda's allocator figures
and NVML replaced by fakes, fed a few steps, serving until a stop file appears.

Only the device readings are fake; the exporter, its labels and the serving are hetrain's own.
`python -m tests.metrics.fake_gpu_rank --port P --stop-file F` (the Prometheus test scrapes it for
the GPU panels a CPU job cannot fill).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from hetrain.metrics import RankMetrics
from hetrain.metrics.events import StepRecord
from tests.metrics.fake_nvml import INDEX, UUID, FakeNvml

TENSOR_ACTIVE = 0.42

ALLOCATOR = {"memory_allocated": 20 * 2**30, "memory_reserved": 24 * 2**30,
             "max_memory_allocated": 22 * 2**30, "max_memory_reserved": 26 * 2**30}


def patch_cuda(setattr_fn=setattr) -> None:
    """Make torch.cuda answer for one GPU whose UUID the fake NVML knows (`setattr_fn`: pytest's monkeypatch.setattr)."""
    setattr_fn(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(uuid=UUID[len("GPU-"):]))
    for name, value in ALLOCATOR.items():
        setattr_fn(torch.cuda, name, lambda device=None, value=value: value)


def step_record(step: int, **changes) -> StepRecord:
    fields = dict(step=step, rank=2, world_size=3, device="a100-sxm4-80gb", precision="bf16", share=512, samples=512,
                  items=512 * 1024, global_samples=1024, global_items=1024 * 1024,
                  step_seconds=None if step == 1 else 0.5, compute_seconds=0.4, data_wait_seconds=0.02,
                  optimizer_seconds=0.05, loss=2.0 / step, grad_norm=1.0, loss_scale=65536.0, skipped=False,
                  skipped_total=0, shares=(512, 256, 256), split_changed=False,
                  comm_bytes={"intra": 4e8, "inter": 1e8}, emulated=False)
    fields.update(changes)
    return StepRecord(**fields)


def fake_gpu_metrics(port: int | None, run_dir: Path | None = None, nvml: FakeNvml | None = None) -> RankMetrics:
    return RankMetrics(rank=2, local_rank=0, world_size=3, device=torch.device("cuda:0"), device_name="a100-sxm4-80gb",
                       port=port, run_dir=run_dir, job="fake-gpu", predicted_step_seconds=0.45,
                       flops_per_item=1.0e8, nvml=nvml or FakeNvml())


def serve_fake_dcgm(port: int) -> None:
    """One series as dcgm-exporter writes it for this GPU (its labels, its `device` naming)."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    gauge = Gauge("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.",
                  ["gpu", "UUID", "device", "modelName", "Hostname"], registry=registry)
    gauge.labels(gpu=str(INDEX), UUID=UUID, device="nvidia3", modelName="NVIDIA A100-SXM4-80GB",
                 Hostname="node-a").set(TENSOR_ACTIVE)
    start_http_server(port, addr="127.0.0.1", registry=registry)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--dcgm-port", type=int, default=None, help="also serve a DCGM exporter's tensor-pipe series")
    args = parser.parse_args()
    if args.dcgm_port is not None:
        serve_fake_dcgm(args.dcgm_port)
    patch_cuda()
    metrics = fake_gpu_metrics(args.port)
    for step in range(1, 4):
        metrics.on_step(step_record(step))
    deadline = time.monotonic() + 120
    while not Path(args.stop_file).exists() and time.monotonic() < deadline:
        metrics.on_step(step_record(step := step + 1))
        time.sleep(0.1)
    metrics.close()


if __name__ == "__main__":
    main()
