"""The run log survives the rank: every step line is on disk however the process ends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetrain.metrics.report import load_run, summary_rows
from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import os, signal, sys
import torch
from hetrain.metrics import RankMetrics
from tests.metrics.fake_gpu_rank import step_record
m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), device_name="cpu", port=None,
                run_dir=sys.argv[1], job="crash")
for step in range(1, 26):
    m.on_step(step_record(step, rank=0, world_size=1, shares=(512,)))
how = sys.argv[2]
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "os_exit":
    os._exit(3)
elif how == "sigterm":          # the default action: no Python code runs
    os.kill(os.getpid(), signal.SIGTERM)
raise RuntimeError("deliberate failure at step 25")
"""


@pytest.mark.parametrize("how", ["raise", "sigterm", "os_exit", "sigkill"])
def test_a_rank_that_dies_leaves_every_step_it_logged(tmp_path, how):
    r = subprocess.run([sys.executable, "-c", RANK, str(tmp_path), how], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0, r.stderr
    (row,) = summary_rows(load_run(tmp_path))
    assert row["steps"] == 25, (how, r.stderr[-2000:])
    if how == "sigkill":
        rep = run_cli([sys.executable, "-m", "hetrain.cli.main", "report", str(tmp_path), "--json"], cwd=ROOT,
                      timeout=120)
        assert rep.returncode == 0, rep.stderr
        assert json.loads(rep.stdout)[0]["steps"] == 25


def test_the_start_line_carries_the_peak_and_flops_per_item_mfu_used(tmp_path, monkeypatch):
    import dataclasses

    import torch

    from hetrain.metrics import RankMetrics
    from hetrain.metrics.run_log import read_lines
    from tests.metrics.fake_gpu_rank import patch_cuda, step_record
    from tests.metrics.fake_nvml import FakeNvml

    patch_cuda(monkeypatch.setattr)   # a GPU rank: a CPU rank has no peak
    m = RankMetrics(rank=0, local_rank=0, world_size=1, device=torch.device("cuda:0"), device_name="a100-sxm4-80gb",
                    port=None, run_dir=tmp_path, job="mfu", predicted_step_seconds=0.45, nvml=FakeNvml())
    m.on_restart(2)
    record = step_record(2, rank=0, world_size=1, shares=(512,), precision="bf16")
    m.on_step(dataclasses.replace(record, model_flops=6.0e12))
    m.close()
    lines = list(read_lines(tmp_path / "metrics" / "rank-0.jsonl"))
    assert [x["kind"] for x in lines] == ["start", "restart", "step"]
    start, step = lines[0], lines[2]
    assert start["peak_flops"] == 312e12 and start["flops_per_item"] == 6.0e12 / record.items
    assert step["mfu"] == 6.0e12 / 0.5 / start["peak_flops"]


def test_a_skipped_steps_inf_loss_is_written_as_strict_json_null(tmp_path):
    from hetrain.metrics.report import loss_series
    from hetrain.metrics.run_log import RunLog, log_path
    from tests.metrics.fake_gpu_rank import step_record

    log = RunLog(tmp_path, 0)
    log.step(step_record(1, rank=0, world_size=1, shares=(512,), loss=1.5))
    log.step(step_record(2, rank=0, world_size=1, shares=(512,), loss=float("inf"), skipped=True, skipped_total=1))
    log.close()

    def strict(token):
        raise ValueError(f"{token} is not JSON")

    lines = [json.loads(line, parse_constant=strict) for line in log_path(tmp_path, 0).read_text().splitlines()]
    assert lines[1]["loss"] is None and lines[1]["skipped"] is True
    run = load_run(tmp_path)
    assert loss_series(run) == [(1, 1.5)]   # the skipped step is a gap in the loss, and still a step
    assert summary_rows(run)[0]["steps"] == 2


def test_the_predicted_step_time_is_the_plans_step_not_a_ranks_compute(tmp_path):
    """It was the rank entry's predicted compute time (0.178 s where the plan's step is 0.202 s), so the
    dashboard's predicted-against-measured panel always showed the measured step about 12% slower."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan
    from hetrain.runtime.reporting import plan_step_seconds

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), predicted_samples_per_s=40.0,
                ranks=[RankPlan(rank=0, share=8, predicted_step_seconds=0.15)])
    assert plan_step_seconds(plan) == pytest.approx(0.2) and plan_step_seconds(None) is None
    assert plan_step_seconds(plan.model_copy(update={"predicted_samples_per_s": None})) is None
    session = hetrain.Session(plan, checkpoint_dir=str(tmp_path))
    net = torch.nn.Linear(4, 2)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    for x, y in session.loader(data, global_batch_size=8):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
    session.close()
    (rank0,) = [r for r in summary_rows(load_run(tmp_path)) if r["rank"] == 0]
    assert rank0["predicted_step_seconds"] == pytest.approx(0.2)


def test_a_full_disk_under_the_run_log_ends_the_log_not_the_training(tmp_path):
    from hetrain.metrics.run_log import RunLog, log_path
    from tests.log_lines import hetrain_warnings

    path = log_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/full")   # every write there fails with ENOSPC, as on a full filesystem
    run_log = RunLog(tmp_path, 0)
    with hetrain_warnings() as warned:
        for step in range(3):
            run_log.write({"kind": "step", "step": step})
    run_log.close()
    assert len(warned) == 1 and "stops here (No space left on device)" in warned[0] and "--run-dir" in warned[0], warned


def test_a_log_left_mid_line_keeps_the_next_runs_first_record(tmp_path):
    """A full disk or a SIGKILL leaves part of a line; the next run's start line was glued to it and lost."""
    from hetrain.metrics.run_log import RunLog, log_path, read_lines

    path = log_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text('{"time": 1.0, "kind": "start", "job": "first"}\n{"ti')
    run_log = RunLog(tmp_path, 0)
    run_log.write({"kind": "start", "job": "second"})
    run_log.close()
    assert [r.get("job") for r in read_lines(path) if r["kind"] == "start"] == ["first", "second"]
