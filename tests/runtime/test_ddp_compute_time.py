"""Compute time under DDP starts at the wrapped module's forward: DDP's own pre-forward collectives
(the second step's bucket rebuild, the buffer broadcast) wait for the other ranks, which is not compute."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from tests.distributed import run_ranks

PAUSE = 0.4   # rank 0's own time after each step: rank 1 waits for it in the next step's first collective
# The bounds are fractions of PAUSE summed over the timed steps, not each step's: a quarter of PAUSE a step
# (0.1 s) is one hiccup of a loaded machine; a wait taken for compute or the script's is PAUSE in a step or more


def _late_rank_zero(rank: int, world: int, with_buffer: bool, sharding: str = "none") -> list[tuple[int, float, float]]:
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    records = []
    plan = Plan(global_batch_size=16, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=8) for r in range(world)])
    with hetrain.Session(plan) as session:
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        if with_buffer:
            net.register_buffer("running", torch.zeros(8))   # DDP broadcasts it before every forward
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=records.append))
        for x, y in session.loader(data, global_batch_size=16, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if rank == 0:
                time.sleep(PAUSE)
    return [(r.step, r.compute_seconds, r.waiting_seconds, r.script_seconds) for r in records
            if r.step_seconds is not None]


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_the_bucket_rebuild_and_buffer_broadcast_waits_are_waiting_on_ranks_not_compute(sharding):
    """Under FSDP2 the wait is in the first forward's all-gather, which ran before hetrain's clock: it was
    counted as the script's own time (0.41 s of 0.4 s waited)."""
    for with_buffer in (False, True):
        steps = run_ranks(_late_rank_zero, 2, with_buffer, sharding)[1]
        assert [s[0] for s in steps] == [2, 3, 4]
        n = len(steps)
        assert sum(s[1] for s in steps) < 0.25 * PAUSE * n, (with_buffer, steps)
        assert sum(s[2] for s in steps) > 0.75 * PAUSE * n, (with_buffer, steps)
        assert sum(s[3] for s in steps) < 0.25 * PAUSE * n, (with_buffer, steps)


class _Slow(torch.nn.Module):
    """A layer that takes PAUSE seconds outside training (an evaluation's long forward)."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            time.sleep(PAUSE)
        return x


def _evaluate_between_steps(rank: int, world: int, through: str) -> list[float]:
    import hetrain

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    records = []
    with hetrain.Session(balance=False) as session:
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), _Slow(), torch.nn.Linear(8, 3))
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=records.append))
        for x, y in session.loader(data, global_batch_size=16, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            with torch.no_grad():   # an evaluation, as docs/data.md shows it or through DDP (generate() does)
                (model.module if through == "module" else model)(x)   # not the next step's compute
    return [r.compute_seconds for r in records if r.step_seconds is not None]


@pytest.mark.parametrize("through", ["module", "wrapped"])
def test_an_evaluation_between_steps_is_not_compute(through):
    """Through the wrapped model it started the next step's compute clock: with generate() on rank 0 two
    equal ranks were re-split [12, 12] -> [7, 17]."""
    for compute in run_ranks(_evaluate_between_steps, 2, through):
        assert compute and sum(compute) < 0.25 * PAUSE * len(compute), compute


class _Block(torch.nn.Module):
    """One of the model's repeated blocks; on rank 0 the middle one takes PAUSE more in a training forward."""

    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.linear, self.slow = torch.nn.Linear(8, 8), slow

    def forward(self, x):
        if self.slow and torch.is_grad_enabled() and torch.distributed.get_rank() == 0:
            time.sleep(PAUSE)
        return torch.tanh(self.linear(x))


def _slow_block_on_rank_zero(rank: int, world: int) -> list[tuple[float, float]]:
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 8, (64,), generator=g))
    records = []
    plan = Plan(global_batch_size=16, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=8) for r in range(world)])
    with hetrain.Session(plan) as session:
        torch.manual_seed(0)
        net = torch.nn.Sequential(_Block(False), _Block(True), _Block(False))
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=records.append))
        for x, y in session.loader(data, global_batch_size=16, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
    return [(r.compute_seconds, r.waiting_seconds) for r in records if r.step_seconds is not None]


def test_under_fsdp2_a_ranks_wait_in_a_blocks_gather_is_waiting_not_compute():
    """Rank 1 waits in the third block's all-gather while rank 0 computes the second block: that wait counted
    as rank 1's compute, and the balancer, reading compute per sample, took it for as slow as rank 0."""
    ranks = run_ranks(_slow_block_on_rank_zero, 2)
    fast = ranks[1]
    assert all(compute > PAUSE for compute, _ in ranks[0])   # rank 0 computed its pause
    assert len(fast) == 3
    assert sum(c for c, _ in fast) < 0.25 * PAUSE * 3 and sum(w for _, w in fast) > 0.75 * PAUSE * 3, fast
