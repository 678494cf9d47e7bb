"""The balancer's starting split and settings: the plan's, with the session's overrides."""

import pytest

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.balance_config import balance_setup


def _plan(enabled=True, interval=7, min_share=1, max_share=None):
    return Plan(global_batch_size=12, balance=BalancePlan(enabled=enabled, interval=interval, min_share=min_share,
                                                          max_share=max_share),
                ranks=[RankPlan(rank=0, share=8), RankPlan(rank=1, share=4)])


def test_without_a_plan_the_split_is_even_and_balancing_on_by_default():
    setup = balance_setup(None, [], 3, 10)
    assert setup.shares == [4, 3, 3]
    assert setup.config.enabled == BalancePlan().enabled
    assert setup.config.interval == BalancePlan().interval


def test_the_plan_gives_the_shares_and_settings_and_the_session_overrides_them():
    plan = _plan()
    setup = balance_setup(plan, [4, 8], 2, 12)          # shares by rank, as the devices were matched
    assert setup.shares == [4, 8]
    assert (setup.config.enabled, setup.config.interval) == (True, 7)
    setup = balance_setup(plan, [4, 8], 2, 12, balance=False, interval=3)
    assert (setup.config.enabled, setup.config.interval) == (False, 3)
    assert plan.balance.enabled and plan.balance.interval == 7   # the plan itself is not changed


def test_a_pipeline_keeps_the_plans_replica_shares():
    assert not balance_setup(_plan(), [8, 4], 2, 12, balance=True, pipeline=True).config.enabled


@pytest.mark.parametrize("args, message", [
    ((_plan(), [8, 4], 2, 16), "the plan is for a global batch of 12, the loader asks for 16"),
    ((_plan(min_share=7), [8, 4], 2, 12), "min_share 7 on 2 ranks needs a global batch of at least 14"),
    ((None, [], 4, 3), "min_share 1 on 4 ranks needs a global batch of at least 4, not 3"),
    ((_plan(max_share=5), [8, 4], 2, 12), r"max_share 5 on 2 ranks holds at most 10 samples, not the global batch"),
    ((_plan(max_share=7), [8, 4], 2, 12), "rank 0 starts at 8 samples, above balance.max_share 7"),
])
def test_a_global_batch_that_cannot_hold_the_settings_is_refused_in_one_line(args, message):
    with pytest.raises(HetrainError, match=message) as info:
        balance_setup(*args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("interval", [0, -3, 2.5, True])
def test_a_balance_interval_that_is_no_count_of_steps_is_refused_in_one_line(interval):
    with pytest.raises(HetrainError, match=r"balance_interval=.*an integer of at least 1"):
        balance_setup(None, [], 2, 12, interval=interval)
    assert balance_setup(_plan(max_share=7), [8, 4], 2, 12, balance=False).config.max_share == 7   # off: not held


@pytest.mark.parametrize("balance", ["no", 0, "false"])
def test_a_balance_setting_that_is_not_a_bool_is_refused_before_the_job_starts(balance):
    """Session(balance="no") turned the balancer on (a non-empty string is true); now refused in one line,
    from the same check Session() runs before its process group exists."""
    from hetrain.runtime.balance_config import balance_overrides

    with pytest.raises(HetrainError, match=r"Session\(balance=.*give True, False or None"):
        balance_overrides(balance, None)
    with pytest.raises(HetrainError, match=r"Session\(balance="):
        balance_setup(None, [], 2, 8, balance=balance)
    import hetrain
    import torch.distributed as dist

    started = dist.is_initialized()   # (an earlier test in this process may have left one)
    with pytest.raises(HetrainError, match=r"Session\(balance="):
        hetrain.Session(balance=balance)
    assert dist.is_initialized() == started   # refused before any process group is made
