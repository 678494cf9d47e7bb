"""`hetrain bench predict --json`: profile on CPU, plan from the profile, run the plan on 2 CPU
ranks, and compare the plan's step time with the job's."""

import json
import sys
from pathlib import Path

from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_bench_predict_plans_from_a_cpu_profile_and_compares_with_the_job():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "predict", "--rounds", "1", "--steps", "10",
                 "--warmup", "3", "--global-batch-size", "256", "--micro-batches", "16,64,128", "--json"],
                cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    assert d["figures"] == {"cpu": "measured-profile"} and d["ranks"] == 2 and sum(d["shares"]) == 256
    assert abs(d["predicted_over_measured"] - d["predicted_step_seconds"] / d["measured_step_seconds"]) < 1e-3
    # CPU seconds do not swing with other users' load: a plan off by its accumulation or its number
    # of ranks would be off by 2x or more here.
    assert 0.6 < d["cpu_predicted_over_measured"] < 1.6
