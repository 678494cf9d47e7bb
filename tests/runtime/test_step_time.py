"""Where a step's wall time goes: the script's own time between steps is not a wait on other ranks."""

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def test_time_the_script_spends_after_step_is_its_own_not_a_wait_on_ranks():
    import hetrain

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    records = []
    with hetrain.Session() as session:
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=records.append))
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            time.sleep(0.05)                       # the script's own work: logging, evaluation
    timed = [r for r in records if r.step_seconds is not None]
    assert len(timed) == 7
    for r in timed:
        assert r.script_seconds == pytest.approx(0.05, abs=0.03)
        assert r.waiting_seconds < 0.02            # one rank waits on no one
        parts = r.compute_seconds + r.data_wait_seconds + r.script_seconds + r.waiting_seconds
        assert parts == pytest.approx(r.step_seconds, abs=1e-9)
