"""The cost model's pipeline step and bubble, for 1F1B and interleaved 1F1B, agree with each other."""

import math

import pytest

from hetrain.planning.cost_model import pipeline_bubble, pipeline_step_seconds
from hetrain.planning.pipeline_planner import in_flight, interleaved_rounds_fit


@pytest.mark.parametrize("p,m,v", [(3, 24, 1), (3, 24, 3), (4, 8, 2), (8, 128, 4), (2, 1, 4), (4, 3, 2)])
def test_the_step_is_the_busy_time_over_one_minus_the_bubble(p, m, v):
    step = pipeline_step_seconds([0.1] * p, m, chunks=v)
    assert math.isclose(1 - m * 0.1 / step, pipeline_bubble(p, m, v))


def test_interleaving_shrinks_the_bubble_and_pays_per_transfer():
    assert math.isclose(pipeline_bubble(3, 24), 2 / 26)
    assert math.isclose(pipeline_bubble(3, 24, 3), 2 / 74)
    # slowest rank 1 s, transfers 0.01 s: (m + (p-1)/v) slots of (slowest + v transfers)
    assert math.isclose(pipeline_step_seconds([1.0, 0.5, 0.8], 8, 0.01, chunks=2), (8 + 1) * 1.02)
    assert math.isclose(pipeline_step_seconds([1.0, 0.5, 0.8], 8, 0.01), 10 * 1.01)


def test_one_micro_batch_through_an_interleaved_pipeline_runs_its_stages_one_after_another():
    # 2 ranks, 4 chunks each, 1 micro-batch: 8 chunk slots of which each rank is busy 4
    assert math.isclose(pipeline_bubble(2, 1, 4), 0.5)
    assert math.isclose(pipeline_step_seconds([1.0, 1.0], 1, chunks=4), 2.0)
    assert math.isclose(pipeline_bubble(4, 3, 2), 1 - 6 / 10)   # (v-1)*p + m + p - 1 = 4 + 3 + 3


def test_activations_in_flight_follow_torchs_warm_up():
    assert [in_flight(4, j, 16, 1) for j in range(4)] == [4, 3, 2, 1]
    # torch's interleaved warm-up: (v-1) * rounds' micro-batches + 2 per hop from the last rank, in chunks
    assert [in_flight(4, j, 16, 2) for j in range(4)] == [6, 5, 4, 3]   # (4 + 2*(3-j) + 1) / 2, rounded up
    assert in_flight(2, 0, 1, 4) == 1


def test_torchs_rounds_rule():
    assert interleaved_rounds_fit(24, 3) and interleaved_rounds_fit(3, 4) and interleaved_rounds_fit(10, 4)
    assert not interleaved_rounds_fit(5, 2)


def test_a_stage_that_holds_a_tied_output_embedding_without_its_owner_counts_its_copy():
    """GPT-2's output projection is its token embedding: a pipeline's last stage keeps its own copy
    (its gradient is summed with the first stage's), so its memory and optimizer hold the embedding."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hetrain.planning.cost_model import memory_estimate
    from hetrain.workload import get_profile
    from hetrain.workload.block_models import gpt2_blocks
    from hetrain.workload.profile import profile

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64))
    measured = profile(gpt2_blocks(model), torch.randint(0, 1000, (2, 32)))
    head = measured.blocks[-1]
    assert (head.tied_params, head.tied_to) == (1000 * 64, 0)
    assert measured.held_params(0, 4) == measured.params == sum(p.numel() for p in model.parameters())
    assert measured.held_params(3, 4) == 1000 * 64 + head.params              # ln_f and the copy
    assert measured.held_params(2, 4) == measured.blocks[2].params + head.params + 1000 * 64
    zoo = get_profile("gpt2-1.5b")
    n = len(zoo.blocks)
    last = memory_estimate(zoo, "bf16", 1, optimizer="adamw", blocks=slice(n - 1, n))
    both = memory_estimate(zoo, "bf16", 1, optimizer="adamw", blocks=slice(0, n))
    assert last.weights >= 4 * 50257 * 1600 and last.optimizer >= 8 * 50257 * 1600
    assert both.weights == memory_estimate(zoo, "bf16", 1, optimizer="adamw").weights   # counted once together
