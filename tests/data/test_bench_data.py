"""`hetrain bench data --json`: one JSON object whose ratios are the figures it reports."""

import json
import sys
from pathlib import Path

import pytest

from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_bench_data_prints_its_figures_as_one_json_object():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "data", "--steps", "3", "--warmup", "2",
                 "--samples", "64", "--global-batch", "16", "--workers", "1", "--json"], cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # each mode trains on its own: a balanced session made beside an even one took its split and never re-split
    assert "takes the split of the one made beside it" not in r.stderr, r.stderr[-3000:]
    d = json.loads(r.stdout)
    ratios = {"equal_speed_ratio": ("hetrain_samples_per_s_1_1", "ddp_samples_per_s_1_1"),
              "speedup": ("hetrain_samples_per_s_1_0.5", "ddp_samples_per_s_1_0.5"),
              "slow_loader_speedup": ("slow_loader_hetrain_samples_per_s", "slow_loader_even_samples_per_s")}
    for name, (num, den) in ratios.items():
        assert d[num] > 0 and d[den] > 0
        assert abs(d[name] - d[num] / d[den]) < 1e-9, name
    for mode in ("1_1", "1_0.5", "slow_loader"):
        for key in (f"balancer_shares_{mode}", f"shares_{mode}"):   # the decision, and the batches
            assert sum(d[key]) == 16 and len(d[key]) == 2, key
    assert d["emulated"] is True and d["workers"] == 1 and d["slow_workers"] == 0


def test_data_wait_is_the_mean_over_the_timed_steps_and_both_splits_are_named(monkeypatch):
    """The wait averaged a fixed last 40 steps, warm-up included when --steps was under 40; and `shares`
    was the loader's split, which trails the balancer's by the prefetch depth."""
    from types import SimpleNamespace

    from hetrain.bench import data_job

    monkeypatch.setattr(data_job, "_gather", lambda value: [value])
    balancer = SimpleNamespace(shares=[43, 21], changes=[SimpleNamespace(step=16, new=[43, 21])])
    mode = SimpleNamespace(waits=[0.5] * 10 + [0.002] * 8, untimed=10,   # 10 warm-up steps, 8 timed
                           session=SimpleNamespace(shares=[42, 22], balancer=balancer))
    got = data_job.Hetrain.figures(mode)
    assert got["data_wait_ms_per_step"] == [pytest.approx(2.0)]
    assert got["balancer_shares"] == [43, 21] and got["loader_shares"] == [42, 22]
    assert got["split_changes"] == [{"step": 16, "new": [43, 21]}]


NO_FORK = """
import os, sys
from torch.utils.data import DataLoader
from hetrain.bench.data_job import JpegImages, worker_options

def forked(*args):
    raise AssertionError("the rank forked a DataLoader worker itself")

os.fork = forked
x, y = next(iter(DataLoader(JpegImages(8), batch_size=4, **worker_options(1))))
print(tuple(x.shape), len(y))
"""


def test_bench_data_starts_its_workers_without_forking_the_rank():
    """A worker forked from a rank whose gloo threads make interpreter thread states can hang in fork on
    CPython before 3.12 (python/cpython#112275): this test's command timed out after 300 s in CI. The bench's
    loaders start their workers from a fork server, a process without threads; os.fork is refused here."""
    r = run_cli([sys.executable, "-c", NO_FORK], cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["(4,", "3,", "32,", "32)", "4"]


def test_bench_data_refuses_a_slowed_loader_that_is_not_slower():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "data", "--workers", "1", "--slow-workers", "1"],
                cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "--slow-workers" in r.stderr and "Traceback" not in r.stderr


def test_emulated_device_time_is_an_identity_that_waits_per_sample():
    import time

    import torch

    from hetrain.bench.emulated_device import DeviceTime

    layer = DeviceTime(ms_per_sample=3.0)          # 1 ms per sample forward, 2 ms backward
    x = torch.randn(20, 4, requires_grad=True)
    t0 = time.perf_counter()
    y = layer(x)
    forward = time.perf_counter() - t0
    t0 = time.perf_counter()
    (y * torch.arange(4.0)).sum().backward()
    backward = time.perf_counter() - t0
    assert torch.equal(y, x) and torch.equal(x.grad, torch.arange(4.0).expand(20, 4))
    assert forward >= 0.015 and backward >= 0.030      # 20 ms and 40 ms, less a late wake-up before
    with torch.no_grad():
        assert torch.equal(layer(x), x)
