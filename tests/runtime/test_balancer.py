"""The balancer's arithmetic: fitted costs, proportional re-splits, hysteresis, bounds, missing figures."""

import pytest

from hetrain.planning.batch_split import RankCost, split_min_max, step_time
from hetrain.planning.plan import BalancePlan
from hetrain.runtime.balancer import Balancer, fit_rank_cost


def test_resplits_in_proportion_to_measured_speed():
    b = Balancer(BalancePlan(interval=5, hysteresis=0.05), shares=[256, 256])
    assert b.rebalance(5, [(256, 0.256), (256, 0.512)])    # rank 1 takes twice as long per sample
    assert b.shares in ([341, 171], [342, 170])             # both give the optimal 0.342 s
    assert b.changes[-1].predicted_new_s < b.changes[-1].predicted_old_s


def test_small_differences_do_not_move_samples():
    b = Balancer(BalancePlan(hysteresis=0.05), shares=[256, 256])
    assert not b.rebalance(5, [(256, 0.256), (256, 0.264)])
    assert b.shares == [256, 256]


def test_fixed_costs_are_fitted_and_the_split_becomes_exact():
    """A step costs fixed + n * per_sample; a slow device is slower at both. Two intervals at
    different shares are enough to find both parts, and the split is then the exact optimum."""
    true = [RankCost(per_sample=0.2e-3, fixed=18e-3), RankCost(per_sample=0.4e-3, fixed=36e-3)]
    b = Balancer(BalancePlan(hysteresis=0.01), shares=[256, 256])
    for step in (5, 10, 15):
        b.rebalance(step, [(n, c.time(n)) for n, c in zip(b.shares, true)])
    best = split_min_max(512, true)
    assert step_time(b.shares, true) == pytest.approx(step_time(best, true))
    assert b.costs[1].fixed == pytest.approx(36e-3) and b.costs[1].per_sample == pytest.approx(0.4e-3)
    # proportional shares would overload the slow rank: its fixed part is not spread over fewer samples
    proportional = [342, 170]
    assert step_time(proportional, true) > 1.05 * step_time(b.shares, true)


def test_fit_rank_cost():
    assert fit_rank_cost([]) is None
    one = fit_rank_cost([(100, 0.5)])
    assert one.fixed == 0 and one.per_sample == pytest.approx(0.005)
    line = fit_rank_cost([(100, 0.3), (200, 0.5), (300, 0.7)])
    assert line.fixed == pytest.approx(0.1) and line.per_sample == pytest.approx(0.002)
    noisy = fit_rank_cost([(100, 0.30), (120, 0.38)])     # would give a negative fixed part
    assert noisy.fixed == 0 and noisy.per_sample == pytest.approx(0.68 / 220)
    close = fit_rank_cost([(100, 0.30), (104, 0.31)])     # shares too close to tell the parts apart
    assert close.fixed == 0 and close.per_sample == pytest.approx(0.31 / 104)


def test_bounds_and_ranks_without_a_measurement():
    b = Balancer(BalancePlan(min_share=10, max_share=300), shares=[100, 100, 100])
    b.rebalance(5, [(100, 0.1), (float("nan"), float("nan")), (100, 10.0)])   # rank 1: no samples
    assert sum(b.shares) == 300 and min(b.shares) >= 10 and max(b.shares) <= 300
    assert b.shares[2] == 10


def test_record_skips_warmup_and_empty_steps():
    b = Balancer(BalancePlan(), shares=[4, 4], warmup_steps=1)
    b.record(4, 100.0)      # warm-up step: not counted
    b.record(0, 5.0)        # no samples: not counted
    b.record(4, 0.4)
    b.record(4, 0.4)
    assert b._samples == 8 and b._steps == 2 and abs(b._seconds - 0.8) < 1e-12
