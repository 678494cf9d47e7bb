"""A device given no samples still runs its step's fixed part (its optimizer step, the backward of exact zeros
that joins the all-reduce): the split models that time, and leaves a device at 0 only where that is faster."""

import itertools
import random

import pytest

from hetrain.planning.batch_split import RankCost, rebalance, split_min_max, step_time


def brute_force(total, costs, hi):
    return min(step_time(s, costs) for s in itertools.product(*[range(h + 1) for h in hi]) if sum(s) == total)


def test_a_rank_at_no_samples_costs_its_fixed_part_or_what_it_measured_there():
    assert RankCost(per_sample=1e-3, fixed=0.15).time(0) == 0.15
    assert RankCost(per_sample=1e-3, fixed=0.15, idle=0.2).time(0) == 0.2


def test_a_rank_whose_fixed_part_outlasts_the_others_step_is_not_sent_idle_for_nothing():
    """The audit's run: rank 1's optimizer step (160 ms) outlasts rank 0's whole step; modelled at 0 ms with no
    samples, the split went to [64, 0] predicting 171.5 -> 77.2 ms, and the step was no shorter."""
    costs = [RankCost(per_sample=0.05e-3, fixed=74e-3), RankCost(per_sample=0.2e-3, fixed=160e-3)]
    new, t_old, t_new = rebalance([41, 23], costs, min_share=0, hysteresis=0.05)
    assert new == [41, 23] and t_new == t_old
    # where idle is really faster (a rank that measured its step at 0 samples), the split still goes there
    fast_idle = [costs[0], RankCost(per_sample=2e-3, fixed=160e-3, idle=100e-3)]
    assert split_min_max(64, fast_idle, 0) == [64, 0]


def test_exact_against_brute_force_with_a_time_at_no_samples():
    """Also where a step at 0 samples takes longer than at 1 (the stand-in backward costs more than a sample)."""
    rng = random.Random(1)
    for _ in range(300):
        ranks = rng.randint(1, 4)
        costs = [RankCost(per_sample=rng.uniform(0.1, 3), fixed=rng.uniform(0, 5),
                          idle=rng.choice([None, rng.uniform(0, 9)])) for _ in range(ranks)]
        hi = [rng.randint(1, 8) for _ in range(ranks)]
        total = rng.randint(0, sum(hi))
        shares = split_min_max(total, costs, 0, hi)
        assert sum(shares) == total and all(0 <= s <= h for s, h in zip(shares, hi))
        assert step_time(shares, costs) == pytest.approx(brute_force(total, costs, hi))
