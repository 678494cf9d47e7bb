"""`hetrain bench memory --json`: every memory strategy on 3 CPU ranks, the same math, less memory."""

import json
import sys
from pathlib import Path

from tests.distributed import run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_bench_memory_shards_the_same_state_and_keeps_the_same_losses():
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "bench", "memory", "--json"], cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    per_rank = got["per_rank"]
    whole = per_rank["none"]["optimizer_state_bytes"]
    assert len(set(whole)) == 1 and whole[0] > 0    # every rank holds all of it without sharding
    for name in ("zero1", "zero1-proportional"):
        assert sum(per_rank[name]["optimizer_state_bytes"]) == whole[0], (name, per_rank[name])
    assert sum(per_rank["fsdp"]["optimizer_state_bytes"]) < 1.02 * whole[0]
    # the rank with the smallest capacity in the plan holds the smallest part under zero1-proportional
    capacities = got["capacities_from_plan"]
    parts = per_rank["zero1-proportional"]["optimizer_state_bytes"]
    assert parts.index(min(parts)) == capacities.index(min(capacities))
    for name, figures in per_rank.items():   # heterogeneity of memory changes memory, never the loss
        assert figures["loss"] == per_rank["none"]["loss"], name
        if name.endswith("+ckpt"):
            base = per_rank[name[:-len("+ckpt")]]["saved_activation_bytes"]
            assert all(c < b / 2 for c, b in zip(figures["saved_activation_bytes"], base)), name
    assert all(got["checks"].values()), got["checks"]
