"""ZeRO-3 (FSDP2) memory under 16-bit autocast: fp32 shards, gathered blocks, and the 16-bit casts backward keeps."""

import pytest

from hetrain.hardware import cluster_from_devices
from hetrain.planning.cost_model import memory_estimate
from hetrain.planning.planner import plan_job
from hetrain.workload import get_profile


def test_zero3_in_16_bit_counts_the_casts_of_every_weight_without_checkpointing():
    """Without activation checkpointing every op saves the 16-bit cast of the gathered weight it used, so a rank
    holds a 16-bit copy of the whole model at the forward's end (1.87 bytes a parameter measured over 2 and 4 CPU
    ranks); the plan counted a 16-bit copy of the rank's shard, 2 / 14 bytes a parameter on 14 ranks."""
    p = get_profile("llama-7b")
    largest = max(b.params for b in p.blocks)
    m = memory_estimate(p, "bf16", 1, optimizer="adamw", zero=3, world=14)
    assert m.weights == pytest.approx(4 * p.params / 14 + 2 * 4 * largest)   # fp32 shard, two blocks gathered
    # the gradient shard, and in backward a block's unsharded gradients and the reduce-scatter's input of them
    assert m.gradients == pytest.approx(4 * p.params / 14 + 2 * 4 * largest)
    assert m.weight_casts == 2 * p.params
    # held with the activations, each micro-batch a pipeline stage keeps in flight its own
    staged = memory_estimate(p, "bf16", 1, optimizer="adamw", zero=3, world=2, blocks=slice(0, 8), in_flight=3)
    assert staged.weight_casts == 3 * 2 * p.held_params(0, 8)
    fp32 = memory_estimate(p, "fp32", 1, optimizer="adamw", zero=3, world=14)
    assert fp32.weight_casts == 0 and fp32.weights == m.weights
    assert memory_estimate(p, "bf16", 1, optimizer="adamw", zero=1, world=14).weight_casts == 0   # counted in weights


def test_zero3_in_16_bit_with_checkpointing_counts_only_the_running_blocks_casts():
    """With checkpointing (and autocast's weight cache off, as hetrain enters it under FSDP2) a block's casts live
    while it is recomputed and back-propagated, and the prefetched block has none yet (measured: at most one
    block's); FSDP2's shards are fp32, so there is no 16-bit shard."""
    p = get_profile("llama-7b")
    largest = max(b.params for b in p.blocks)
    m = memory_estimate(p, "fp16", 1, optimizer="adamw", zero=3, world=14, checkpointing=True)
    assert m.weights == pytest.approx(4 * p.params / 14 + (2 * 4 + 2) * largest)
    assert m.weight_casts == 0


def test_an_idle_zero3_rank_checkpoints_its_empty_pieces_where_their_casts_would_not_fit():
    """An idle ZeRO-3 rank still runs the job's pieces (empty) and its ops cast every gathered weight, keeping
    the casts for backward unless it checkpoints: 3 idle RTX 3060s beside an H100 on GPT-2 1.5B were planned
    without checkpointing, at 12.08 GB on 12 GB cards."""
    result = plan_job(cluster_from_devices("h100:1,rtx-3060:3"), get_profile("gpt2-1.5b"), 4, strategy="zero3")
    idle = [r for r in result.plan.ranks if r.share == 0]
    assert len(idle) == 3 and all(r.activation_checkpointing for r in idle)
    assert all(r.memory_bytes <= r.memory_capacity_bytes for r in result.plan.ranks)
    # one that fits without them runs without
    roomy = plan_job(cluster_from_devices("h100:4,rtx-3060:4"), get_profile("gpt2-1.5b"), 8, strategy="zero3")
    assert not any(r.activation_checkpointing for r in roomy.plan.ranks if r.share == 0)
