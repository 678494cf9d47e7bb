"""A loss.backward() of the script's own inside a step: refused where its gradient would join the update
unweighted by the rank's share (and, under DDP, not all-reduced), left out where it comes before the step."""

import pytest
import torch
import torch.nn.functional as F

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.runtime.test_refusals import make_data, make_net


def _session(micro_batch=None):
    import hetrain

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8, micro_batch=micro_batch)]) if micro_batch else None
    session = hetrain.Session(plan)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return session, model, optimizer, iter(session.loader(make_data(), global_batch_size=8, shuffle=False))


def test_a_second_loss_backward_ed_on_its_own_after_session_backward_is_refused_at_the_step():
    session, model, _, batches = _session()
    x, y = next(batches)
    out = model(x)
    session.backward(F.cross_entropy(out, y))
    model(x).pow(2).mean().backward()   # an auxiliary loss on its own: unweighted by the rank's share
    with pytest.raises(HetrainError, match=r"after session.backward\(\) in this step.*session.backward\(loss_a \+ loss_b\)"):
        session.step()
    session.close()


def test_the_second_pass_of_a_two_pass_update_is_refused_naming_it():
    session, model, optimizer, batches = _session()
    x, y = next(batches)
    session.backward(F.cross_entropy(model(x), y))   # SAM: the first gradient, then a step up it ...
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.grad)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()          # ... and the gradient there, by torch's own backward
    with pytest.raises(HetrainError, match=r"two gradients in turn \(SAM\)"):
        session.step()
    session.close()


def test_a_loss_backward_ed_before_session_backward_on_one_forward_is_refused_at_once():
    session, model, _, batches = _session()
    x, y = next(batches)
    out = model(x)
    out.pow(2).mean().backward(retain_graph=True)
    with pytest.raises(HetrainError, match=r"ran through this forward before session.backward\(\)"):
        session.backward(F.cross_entropy(out, y))
    session.close()


@pytest.mark.parametrize("micro_batch", [None, 4])
def test_a_backward_of_its_own_before_the_step_is_left_out_and_the_session_trains_on(micro_batch):
    """As before: gradients written before the step's first session.backward() are not the step's (logged)."""
    session, model, _, batches = _session(micro_batch)
    x, y = next(batches)
    F.cross_entropy(model(x), y).backward()   # a look at a gradient on its own forward, before the step
    for _ in range(2 if micro_batch else 1):
        session.backward(F.cross_entropy(model(x), y))
        applied = session.step()
        if not applied:
            x, y = next(batches)
    assert applied
    x, y = next(batches)
    session.backward(F.cross_entropy(model(x), y))   # the next steps go on as usual
    session.close()


def test_a_plain_backward_between_micro_batches_is_refused_at_the_step():
    session, model, _, batches = _session(micro_batch=4)
    x, y = next(batches)
    session.backward(F.cross_entropy(model(x), y))
    assert not session.step()
    x, y = next(batches)
    F.cross_entropy(model(x), y).backward()   # the second piece once more by torch's backward
    session.backward(F.cross_entropy(model(x), y))
    with pytest.raises(HetrainError, match=r"after session.backward\(\) in this step"):
        session.step()
    session.close()
