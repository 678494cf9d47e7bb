"""A long run keeps bounded state: per-step timings do not grow with the number of steps."""

import torch
from torch.utils.data import TensorDataset

from hetrain.runtime.session import TIMING_HISTORY


def test_step_timings_are_bounded_over_many_steps():
    import hetrain

    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    with hetrain.Session(balance_interval=50) as session:
        net = torch.nn.Linear(4, 1)
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
        loader = session.loader(data, global_batch_size=64)
        while session.step_count < TIMING_HISTORY + 200:
            for x, y in loader:
                session.backward(torch.nn.functional.mse_loss(model(x), y))
                session.step()
        assert len(session.step_seconds) == len(session.compute_seconds) == TIMING_HISTORY
        assert len(session.balancer.history[0]) <= session.balancer.config.history


def test_a_balancer_turned_off_keeps_no_per_step_timings():
    """Its interval's timings were emptied only when a re-split was due, never when balancing is off (and under
    every pipeline plan): one entry a step in memory and in every checkpoint (21 KB of 24 KB after 1000 steps)."""
    from hetrain.planning.plan import BalancePlan
    from hetrain.runtime.balancer import Balancer

    balancer = Balancer(config=BalancePlan(enabled=False, interval=20), shares=[8], rank=0)
    for _ in range(1000):
        balancer.record(8, 0.01)
    assert len(balancer.local_state_dict()["interval"]) <= 20   # the rank's own checkpoint state
