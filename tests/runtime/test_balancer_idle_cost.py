"""A rank at 0 samples still runs its step's fixed part: the balancer models that time (the optimizer's seconds
every rank measures at any share, then what its steps at 0 samples took), so its predictions hold and it sends
a rank idle only where that shortens the step. Synthetic step times, deterministic, without processes."""

import random

from hetrain.metrics.events import SPLIT_REASONS
from hetrain.planning.plan import BalancePlan
from hetrain.runtime.balancer import Balancer
from tests.metrics.fake_gpu_rank import step_record

# as in the audit's run (2M optimizer-only parameters, emulated speeds 1 and 0.4): rank r's optimizer step,
# the rest of its step's fixed part, its cost per sample, and what its step at 0 samples adds to the optimizer
# (the backward of exact zeros over every parameter)
OPTIMIZER, FIXED, PER_SAMPLE, STAND_IN = (30e-3, 160e-3), (8e-3, 10e-3), (0.05e-3, 0.5e-3), (6e-3, 15e-3)


def true_time(r, n):
    return OPTIMIZER[r] + (FIXED[r] + n * PER_SAMPLE[r] if n else STAND_IN[r])


def _run(steps=300, noise=0.02, seed=0, shares=(32, 32), time=true_time, config=None):
    rng = random.Random(seed)
    config = config or BalancePlan(interval=5, min_share=0)
    ranks = [Balancer(config.model_copy(), shares=list(shares), rank=r) for r in range(len(shares))]
    splits = []
    for step in range(1, steps + 1):
        now = list(ranks[0].shares)
        splits.append(now)
        for r, b in enumerate(ranks):
            scatter = rng.uniform(1 - noise, 1 + noise)
            b.record(now[r], time(r, now[r]) * scatter, OPTIMIZER[r] * scatter)
        if ranks[0].due(step):
            observed = [b.take_measurement() for b in ranks]
            assert len({b.rebalance(step, observed) for b in ranks}) == 1
    return ranks[0].changes, splits


def test_predictions_hold_and_a_rank_is_not_left_idle_where_one_sample_is_faster():
    """Modelled at 0 ms with no samples and through the origin, rank 1 went to [64, 0] predicting 186.0 ->
    41.4 ms (true: 175.0) and, its step at 0 samples measuring nothing, stayed there."""
    changes, splits = _run()
    for c in changes:
        true = max(true_time(r, n) for r, n in enumerate(c.new))
        # a rank's time at 0 samples before it ran one is its fixed part's least: its optimizer step
        off = STAND_IN[1] + FIXED[1] if c.new[1] == 0 and c.reason == "balance" else 0.0
        assert abs(c.predicted_new_s - true) <= 0.05 * true + off, (c, true)
    assert splits[-1][1] > 0 and all(s[1] > 0 for s in splits[-100:]), changes
    assert max(true_time(r, n) for r, n in enumerate(splits[-1])) < true_time(1, 0)
    assert {c.reason for c in changes} <= set(SPLIT_REASONS)


def test_a_rank_whose_idle_step_is_fast_still_goes_idle():
    """Where a step at 0 samples is short (little to update) and a sample dear, 0 samples is still the best."""
    def time(r, n):
        return (2e-3 + n * 0.1e-3) if r == 0 else ((40e-3 + n * 2e-3) if n else 1e-3)
    changes, splits = _run(steps=200, shares=(128, 128), time=time)
    assert splits[-1] == [256, 0], changes


def test_equal_ranks_with_a_large_optimizer_step_keep_their_split():
    """Equal ranks with an optimizer step larger than their samples' work keep their split under noise: the line
    through the optimizer's seconds is flatter than one through the origin (a gap moves more samples), and what
    keeps the split is the significance gate, which the floor leaves as it was."""
    def time(r, n):
        return OPTIMIZER[0] + FIXED[0] + n * PER_SAMPLE[0]
    for seed in range(3):
        changes, _ = _run(steps=300, seed=seed, time=time, config=BalancePlan(interval=5, min_share=0))
        assert changes == [], changes


def test_the_step_record_says_why_the_split_changed():
    """A re-split for speed, a rank at 0 samples given one to measure it again, the split it came from again."""
    def time(r, n):
        return (2e-3 + n * 0.1e-3) if r == 0 else ((40e-3 + n * 2e-3) if n else 1e-3)
    b = Balancer(BalancePlan(interval=5, min_share=0), shares=[128, 128], rank=0)
    changes, _ = _run(steps=400, shares=(128, 128), time=time)
    assert [c.reason for c in changes][-2:] == ["try", "back"] and changes[0].reason == "balance"
    b.changes = changes
    assert b.with_reason(step_record(5, split_changed=True)).split_reason == "back"
    assert b.with_reason(step_record(6)).split_reason is None


def test_a_rank_at_no_samples_reports_what_its_steps_took_there():
    b = Balancer(BalancePlan(interval=5, min_share=0), shares=[8, 0], rank=1, warmup_steps=0)
    for t in (0.2, 0.3, 0.25):
        b.record(0, t, 0.1)
    m = b.take_measurement()
    assert m.idle_seconds == 0.25 and m.optimizer_seconds == 0.1 and not m.has_window()
    partial = Balancer(BalancePlan(interval=5, min_share=0), shares=[8, 1], rank=1, warmup_steps=0)
    partial.record(0, 0.2, 0.1)    # a last, partial batch left it none: not its step at 0 samples
    assert not partial.take_measurement().has_idle()
