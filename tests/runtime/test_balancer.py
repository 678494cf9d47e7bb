"""The balancer's arithmetic: proportional re-splits, hysteresis, smoothing, bounds, missing figures."""

from hetrain.planning.plan import BalancePlan
from hetrain.runtime.balancer import Balancer


def test_resplits_in_proportion_to_measured_speed():
    b = Balancer(BalancePlan(interval=5, hysteresis=0.05), shares=[256, 256])
    assert b.rebalance(5, [1e-3, 2e-3])          # rank 1 takes twice as long per sample
    assert b.shares in ([341, 171], [342, 170])   # both give the optimal 0.342 s
    assert b.changes[-1].predicted_new_s < b.changes[-1].predicted_old_s


def test_small_differences_do_not_move_samples():
    b = Balancer(BalancePlan(hysteresis=0.05), shares=[256, 256])
    assert not b.rebalance(5, [1.00e-3, 1.03e-3])
    assert b.shares == [256, 256]


def test_one_noisy_interval_is_averaged_with_the_earlier_ones():
    b = Balancer(BalancePlan(hysteresis=0.05, smoothing=0.5), shares=[256, 256])
    b.rebalance(5, [1e-3, 1e-3])
    assert not b.rebalance(10, [1e-3, 1.12e-3])  # alone this would move samples; averaged, it does not
    assert b.rebalance(15, [1e-3, 1.5e-3])        # a lasting change does
    assert b.shares[0] > b.shares[1]


def test_bounds_and_ranks_without_a_measurement():
    b = Balancer(BalancePlan(min_share=10, max_share=300), shares=[100, 100, 100])
    b.rebalance(5, [1e-3, float("nan"), 1e-1])    # rank 1 had no samples: assumed average
    assert sum(b.shares) == 300 and min(b.shares) >= 10 and max(b.shares) <= 300
    assert b.shares[2] == 10


def test_record_skips_warmup_and_empty_steps():
    b = Balancer(BalancePlan(), shares=[4, 4], warmup_steps=1)
    b.record(4, 100.0)      # warm-up step: not counted
    b.record(0, 5.0)        # no samples: not counted
    b.record(4, 0.4)
    b.record(4, 0.4)
    assert b._samples == 8 and abs(b._seconds - 0.8) < 1e-12
