"""A rank at 0 samples computes nothing useful for its step's time: its MFU is 0, not the last step's, and the
report's mean MFU is the model FLOPs of the steps over their time (what the gauge's figures add up to)."""

import json

import pytest
import torch

from hetrain.metrics import RankMetrics
from hetrain.metrics.mfu import mfu
from hetrain.metrics.report import read_rank, summary_row
from hetrain.metrics.run_log import log_path
from tests.metrics.fake_gpu_rank import step_record


def test_a_step_without_flops_has_mfu_zero_and_a_missing_figure_none():
    assert mfu(0.0, 1, 0.2, 1e9) == 0.0 and mfu(1e6, 0, 0.2, 1e9) == 0.0
    assert mfu(None, 4, 0.2, 1e9) is None and mfu(1e6, 4, 0.2, None) is None and mfu(1e6, 4, None, 1e9) is None


def _metrics(tmp_path):
    return RankMetrics(rank=1, local_rank=0, world_size=2, device=torch.device("cpu"), device_name="cpu", port=None,
                       run_dir=tmp_path, job="idle", peak_flops=1e9)


def gauge(m):
    [value] = [s.value for f in m.registry.collect() for s in f.samples if s.name == "hetrain_mfu_ratio"]
    return value


def test_the_gauge_and_the_report_count_a_step_at_no_samples():
    """The audit's run A, rank 1: the report said 1.07e-3 from its steps with samples alone; counting its steps
    at 0 samples it is 4.2e-4 (total FLOPs over total time)."""
    m = _metrics(None)
    m.on_step(step_record(2, rank=1, model_flops=4e8, step_seconds=0.2, samples=32))
    assert gauge(m) == pytest.approx(2.0)
    m.on_step(step_record(3, rank=1, model_flops=0.0, step_seconds=0.3, samples=0, share=0, items=0))
    assert gauge(m) == 0.0


def test_the_report_mean_is_flops_over_time(tmp_path):
    m = _metrics(tmp_path)
    m.on_step(step_record(1, rank=1, model_flops=4e8, step_seconds=None))
    for step, (flops, seconds) in enumerate([(4e8, 0.2), (0.0, 0.3), (0.0, 0.5), (6e8, 0.2)], start=2):
        m.on_step(step_record(step, rank=1, model_flops=flops, step_seconds=seconds, samples=32 if flops else 0))
    m.close()
    lines = [json.loads(line) for line in open(log_path(tmp_path, 1))]
    assert [s["mfu"] for s in lines if s["kind"] == "step"][1:] == pytest.approx([2.0, 0.0, 0.0, 3.0])
    assert summary_row(read_rank(1, log_path(tmp_path, 1)))["mfu"] == pytest.approx(10e8 / 1.2 / 1e9)
