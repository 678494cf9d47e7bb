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


def test_the_largest_model_by_free_memory_leaves_every_device_its_weights_and_gradients():
    """A V100 that could not hold the model's weights and gradients (68 GB at 21 layers) passed, its room for
    optimizer state counted as none, while the A100s covered the state: 4.36 B parameters, 1.86x."""
    from hetrain.bench.memory import largest_models, transformer_of_layers
    from hetrain.planning import cost_model as cm

    approaches = largest_models("a100x4+v100x4")["approaches"]
    layers = approaches["zero1-proportional"]["layers"]
    assert approaches["zero1"]["layers"] <= layers <= approaches["fsdp"]["layers"]
    v100 = 32 * 10**9
    bare = cm.memory_estimate(transformer_of_layers(layers), "fp16", 1, zero=0, world=8, checkpointing=True)
    assert bare.weights + bare.gradients + bare.activations < v100
    more = cm.memory_estimate(transformer_of_layers(layers + 1), "fp16", 1, zero=0, world=8, checkpointing=True)
    assert (more.weights + more.gradients + more.activations) * (1 + cm.FRAGMENTATION) > 0.9 * v100
