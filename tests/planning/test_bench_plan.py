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


def test_every_point_plans_the_device_count_it_is_labelled_with(monkeypatch):
    """`seconds_by_kinds_512_devices` planned 480 devices for 6 kinds (512 // 6 // 8 nodes of 8 per kind)."""
    import argparse
    from types import SimpleNamespace

    import hetrain.planning.planner as planner
    from hetrain.bench import plan as bench_plan

    planned = []

    def fake_plan_job(cluster, profile, batch):
        planned.append((cluster.size, len({d.model for n in cluster.nodes for d in n.devices})))
        return SimpleNamespace(plan=SimpleNamespace(strategy="ddp", predicted_samples_per_s=1.0))

    monkeypatch.setattr(planner, "plan_job", fake_plan_job)
    got = bench_plan.run(argparse.Namespace(model="gpt2-1.5b", repeat=1))
    by_kinds = planned[-4:]
    assert [kinds for _, kinds in by_kinds] == [int(k) for k in got["seconds_by_kinds_512_devices"]] == [1, 2, 4, 6]
    assert [size for size, _ in by_kinds] == [512] * 4
    by_devices = planned[2:6]   # after mix1024's timed run and its plan
    assert [size for size, _ in by_devices] == [int(n) for n in got["seconds_by_devices_4_kinds"]]
