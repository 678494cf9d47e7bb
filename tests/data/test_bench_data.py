"""`hetrain bench data --json`: one JSON object whose ratios are the figures it reports."""

import json
import sys
from pathlib import Path

from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_bench_data_prints_its_figures_as_one_json_object():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "data", "--steps", "3", "--warmup", "2",
                 "--samples", "64", "--global-batch", "16", "--workers", "1", "--json"], cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    ratios = {"equal_speed_ratio": ("hetrain_samples_per_s_1_1", "ddp_samples_per_s_1_1"),
              "speedup": ("hetrain_samples_per_s_1_0.5", "ddp_samples_per_s_1_0.5"),
              "slow_loader_speedup": ("slow_loader_hetrain_samples_per_s", "slow_loader_even_samples_per_s")}
    for name, (num, den) in ratios.items():
        assert d[num] > 0 and d[den] > 0
        assert abs(d[name] - d[num] / d[den]) < 1e-9, name
    for key in ("shares_1_1", "shares_1_0.5", "shares_slow_loader"):
        assert sum(d[key]) == 16 and len(d[key]) == 2
    assert d["emulated"] is True and d["workers"] == 1 and d["slow_workers"] == 0


def test_bench_data_refuses_a_slowed_loader_that_is_not_slower():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "data", "--workers", "1", "--slow-workers", "1"],
                cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "--slow-workers" in r.stderr and "Traceback" not in r.stderr
