"""`session.global_mean` weights each rank by its items, at any point of the loop."""

import math

import torch
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks

ITEMS = [2, 6]          # items each rank's loss averages over (rank 0 has 3 samples, rank 1 has 1)


def _loop(rank, world):
    import hetrain

    plan = Plan(global_batch_size=4, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=3), RankPlan(rank=1, share=1)])
    session = hetrain.Session(plan)
    net = torch.nn.Linear(2, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(TensorDataset(torch.randn(8, 2)), global_batch_size=4, shuffle=False)
    value = float(rank + 1)
    try:
        seen = {"before_any_batch": session.global_mean(value)}
    except hetrain.HetrainError as e:   # no items yet to weigh by
        seen = {"before_any_batch": str(e)}
    seen["plain"] = session.global_mean(value, weight=1)
    for (x,) in loader:
        seen["after_the_batch"] = session.global_mean(value)          # weighted by samples: 3 and 1
        session.backward(model(x).mean(), num_items=ITEMS[rank])
        seen["after_backward"] = session.global_mean(value)           # by items: 2 and 6
        session.step()
        seen["after_step"] = session.global_mean(value)               # the finished step's items
        seen["loss"] = session.loss
        break
    session.close()
    return seen


def test_global_mean_is_weighted_by_items_before_and_after_backward_and_after_step():
    seen = run_ranks(_loop, 2)
    for rank in range(2):
        # it was NaN on every rank, said by nothing (every rank weighed 0)
        assert "no step has run in this process yet" in seen[rank]["before_any_batch"] and "weight=" in \
            seen[rank]["before_any_batch"], seen[rank]
        assert seen[rank]["plain"] == 1.5
        assert seen[rank]["after_the_batch"] == (1 * 3 + 2 * 1) / 4
        assert seen[rank]["after_backward"] == (1 * 2 + 2 * 6) / 8
        assert seen[rank]["after_step"] == (1 * 2 + 2 * 6) / 8
        assert math.isfinite(seen[rank]["loss"])
    assert seen[0]["loss"] == seen[1]["loss"]


def test_a_vector_is_refused_naming_what_global_mean_takes():
    """A vector of figures failed inside torch ('a Tensor with 2 elements cannot be converted to Scalar')."""
    import pytest

    from hetrain.errors import HetrainError
    from hetrain.runtime.gradients import weighted_mean

    with pytest.raises(HetrainError, match="one number per rank"):
        weighted_mean(torch.tensor([1.0, 2.0]), 1.0, torch.device("cpu"))


def test_a_float64_figure_keeps_its_precision():
    """A float64 tensor was rounded to float32 before the float64 all-reduce: 1e8 + 0.5 came back as 1e8."""
    import hetrain

    with hetrain.Session(balance=False) as session:
        assert session.global_mean(torch.tensor(1e8 + 0.5, dtype=torch.float64), weight=1) == 1e8 + 0.5
        assert session.global_mean(torch.tensor(3, dtype=torch.int64), weight=1) == 3.0


def test_collectives_after_close_name_the_closed_session():
    """After close() global_mean(), evaluate() and barrier() failed with torch's 'Default process group has not
    been initialized', where step() names the closed session and the fix."""
    import pytest

    import hetrain
    from hetrain.errors import HetrainError

    session = hetrain.Session(balance=False)
    net = torch.nn.Linear(3, 1)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    session.close()
    for call in (lambda: session.global_mean(1.0, weight=1), session.barrier,
                 lambda: session.evaluate(torch.ones(2, 3), torch.ones(2, 1), torch.nn.functional.mse_loss)):
        with pytest.raises(HetrainError, match="the session was closed"):
            call()


def test_a_weight_or_a_step_count_that_cannot_be_one_is_refused_naming_what_it_is():
    """weight=-1 on one rank (the weights then summed to 0) and weight=nan gave nan without a word; idle_fraction's
    last=0 measured every step and last=-1 dropped the first."""
    import pytest

    import hetrain
    from hetrain.errors import HetrainError

    with hetrain.Session(balance=False) as session:
        for weight in (-1, float("nan"), float("inf")):
            with pytest.raises(HetrainError, match=r"global_mean\(weight=.*\): a weight is what this rank's value"):
                session.global_mean(1.0, weight=weight)
        assert session.global_mean(2.0, weight=0) != session.global_mean(2.0, weight=0)   # no items anywhere: NaN
        for last in (0, -1, 1.5):
            with pytest.raises(HetrainError, match=r"idle_fraction\(last=.*\): the number of recent steps"):
                session.idle_fraction(last=last)
        assert session.idle_fraction(last=3) == 0.0   # no step yet
