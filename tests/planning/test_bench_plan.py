"""`hetrain bench plan --json`: planning time on large clusters, one run per point."""

import json
import sys
from pathlib import Path

from hetrain.vocabulary import SHARDINGS, STRATEGIES
from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_bench_plan_plans_every_point_and_prints_one_json_object():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "plan", "--json", "--repeat", "1"],
                cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["mix1024_strategy"] in set(STRATEGIES) | set(SHARDINGS), got
    assert got["mix1024_predicted_samples_per_s"] > 0
    assert sorted(map(int, got["seconds_by_devices_4_kinds"])) == [32, 128, 512, 2048]
    assert all(s > 0 for s in got["seconds_by_devices_4_kinds"].values())
    assert isinstance(got["meets_target"], bool) and got["target_seconds"] > 0
