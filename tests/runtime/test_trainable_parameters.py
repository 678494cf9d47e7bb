"""Parameters a forward leaves without a gradient, and parameters unfrozen mid-run, under DDP and ZeRO-1:
the update is one process's on the global batch, on uneven shares."""

import pytest
import torch
from torch import nn

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks

SHARES = [5, 3]
LR = 0.1
STEPS = 5
UNFREEZE_AT = 2


class _TwoHeads(nn.Module):
    """A body and two heads, both used, or one (a branch some batches take)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head_a, self.head_b = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        if use_b is None:
            return self.head_a(h) + self.head_b(h)
        return self.head_b(h) if use_b else self.head_a(h)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(SHARES) * STEPS, 4, generator=g), torch.randn(sum(SHARES) * STEPS, 1, generator=g)


def _reference(case):
    net, (x, y) = _TwoHeads(), _data()
    if case == "unfreeze":
        net.body.requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    n = sum(SHARES)
    for step in range(STEPS):
        if case == "unfreeze" and step == UNFREEZE_AT:
            net.body.requires_grad_(True)
        out = net(x[step * n:(step + 1) * n], use_b=step % 2 == 1 if case == "unused" else None)
        nn.functional.mse_loss(out, y[step * n:(step + 1) * n]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()]


def _train(rank, world, case, sharding, find_unused):
    import hetrain

    plan = Plan(global_batch_size=sum(SHARES), sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(SHARES)])
    session = hetrain.Session(plan)
    net = _TwoHeads()
    if case == "unfreeze":
        net.body.requires_grad_(False)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                               find_unused_parameters=find_unused)
    x, y = _data()
    try:
        for xb, yb in session.loader(torch.utils.data.TensorDataset(x, y), global_batch_size=sum(SHARES),
                                     shuffle=False):
            if case == "unfreeze" and session.step_count == UNFREEZE_AT:
                net.body.requires_grad_(True)
            use_b = session.step_count % 2 == 1 if case == "unused" else None
            session.backward(nn.functional.mse_loss(model(xb, use_b), yb))
            session.step()
    except hetrain.HetrainError as e:
        return str(e)
    finally:
        session.close()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("sharding", ["none", "zero1"])
def test_parameters_unfrozen_mid_run_are_reduced_like_the_others(sharding):
    """DDP's buckets hold the parameters trainable when it was built: an unfrozen body's gradients stayed
    each rank's own (the ranks' copies 0.03 apart after 5 steps; ZeRO-1 agreed on a wrong one)."""
    want = _reference("unfreeze")
    for got in run_ranks(_train, 2, "unfreeze", sharding, False):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_forward_that_leaves_parameters_without_gradient_is_named_and_find_unused_parameters_trains_it():
    """It was reported as a forward through the unwrapped model; DDP's own setting makes it exact."""
    errors = run_ranks(_train, 2, "unused", "none", False)
    assert all("some parameters got no gradient" in e and "find_unused_parameters=True" in e for e in errors), errors
    want = _reference("unused")
    for got in run_ranks(_train, 2, "unused", "zero1", True):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
