"""Heterogeneity changes speed, never the math: weighted gradients equal the global-batch gradient."""

import torch
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def reference_grads(indices: list[int]) -> list[torch.Tensor]:
    model, data = make_model(), make_data()
    x, y = data[indices]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _train_steps(rank, world, splits, steps):
    import hetrain

    plan = Plan(global_batch_size=sum(splits[0]),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(splits[0])],
                balance=BalancePlan(enabled=False))
    session = hetrain.Session(plan)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
    loader = session.loader(make_data(), global_batch_size=sum(splits[0]), shuffle=True, seed=3)
    out = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = torch.nn.functional.cross_entropy(model(x), y) if len(x) else model(x).sum()
        session.backward(loss)
        out.append([p.grad.clone() for p in model.parameters()])
        session.optimizer.zero_grad(set_to_none=True)   # no step: the next batch begins the next step
        session.balancer.shares = list(splits[(step + 1) % len(splits)])  # re-split between steps
    return out


def _check(splits, steps=1):
    world = len(splits[0])
    results = run_ranks(_train_steps, world, splits, steps)
    from hetrain.runtime.data import GlobalBatchOrder

    order = GlobalBatchOrder(24, sum(splits[0]), shuffle=True, seed=3)
    for step in range(steps):
        ref = reference_grads(order.global_batch(0, step))
        for rank in range(world):
            for got, want in zip(results[rank][step], ref):
                assert (got - want).abs().max().item() < 1e-5, (step, rank)


def test_three_ranks_shares_5_2_1_equal_single_process_gradient():
    _check([[5, 2, 1]])


def test_two_ranks_uneven_split():
    _check([[7, 1]])


def test_split_changing_between_steps_and_a_zero_share():
    _check([[5, 2, 1], [1, 1, 6], [0, 3, 5]], steps=3)


def _compressed_grads(rank, world, compression):
    import hetrain
    from hetrain.planning.plan import CommPlan

    shares = [5, 2, 1]
    plan = Plan(global_batch_size=8, ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(shares)],
                balance=BalancePlan(enabled=False), comm=CommPlan(compression=compression))
    session = hetrain.Session(plan)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=True, seed=3)
    x, y = next(iter(loader))
    session.backward(torch.nn.functional.cross_entropy(model(x), y))
    return [p.grad.clone() for p in model.parameters()]


def test_plan_compression_keeps_weighted_gradients_to_its_precision():
    """The plan's fp16 compression runs inside the Session's hook chain; uneven shares stay exact to fp16."""
    from hetrain.runtime.data import GlobalBatchOrder

    ref = reference_grads(GlobalBatchOrder(24, 8, shuffle=True, seed=3).global_batch(0, 0))
    for grads in run_ranks(_compressed_grads, 3, "fp16"):
        for got, want in zip(grads, ref):
            assert (got - want).abs().max().item() < 2e-3 * max(1.0, want.abs().max().item())


def test_complex_gradients_are_checked_and_unscaled():
    """A model with complex parameters crashed in the fused inf check (no complex kernel)."""
    from hetrain.runtime.gradients import has_non_finite

    g = torch.ones(3, dtype=torch.cfloat)
    assert not has_non_finite([g], torch.device("cpu"))
    g[1] = complex(0, float("inf"))
    assert has_non_finite([g, torch.ones(2)], torch.device("cpu"))
