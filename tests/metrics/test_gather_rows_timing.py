"""session.gather_rows() inside a step (a contrastive loss over every rank's rows): a fast rank's wait in its
collectives for a slower rank, in the forward's gather or in its backward's all-reduce, is waiting, not its
compute. Timed as compute it made both ranks look equally slow: the balancer kept 12/12 for 40 steps where
without the gather it moved to 23/1."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tests.distributed import run_ranks

SLEEP_S = 0.03
STEPS = 8


class _Records:
    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a slower device's backward before the gather's."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP_S)
        return grad


def _train(rank: int, world: int, where: str) -> dict[str, float]:
    import hetrain

    session = hetrain.Session()
    net = torch.nn.Linear(16, 8)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = _Records()
    session.add_observer(seen)
    data = torch.utils.data.TensorDataset(torch.randn(24 * (STEPS + 1), 16))
    for (x,) in session.loader(data, global_batch_size=24):
        z = model(x)
        if rank == 1 and where == "forward":
            time.sleep(SLEEP_S)   # a slower device's forward
        every, first = session.gather_rows(z, offset=True)
        if rank == 1 and where == "backward":
            every = _SlowBackward.apply(every)
        loss = F.cross_entropy(z @ every.T, torch.arange(len(z)) + first)   # each row against every rank's rows
        session.backward(loss)
        session.step()
        if session.step_count >= STEPS:
            break
    session.close()
    timed = [r for r in seen.records if r.step_seconds is not None]
    return {"slept": SLEEP_S * len(timed) if rank == 1 else 0.0,
            "compute": sum(r.compute_seconds for r in timed), "ranks": sum(r.waiting_seconds for r in timed)}


def _check(where: str) -> None:
    fast, slow = run_ranks(_train, 2, where)
    slept = slow["slept"]
    assert slow["compute"] >= 0.8 * slept, slow
    assert fast["compute"] < 0.5 * slept and fast["ranks"] >= 0.4 * slept, (fast, slept)


def test_a_fast_ranks_wait_in_gather_rows_for_a_slower_forward_is_not_its_compute():
    _check("forward")


def test_a_fast_ranks_wait_in_gather_rows_backward_for_a_slower_backward_is_not_its_compute():
    _check("backward")
