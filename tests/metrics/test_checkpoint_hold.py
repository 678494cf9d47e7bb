"""A save's reported blocking time is the time it held the loop: capturing the state included. On the fake clock
(tests/fake_clock.py), so the three figures of one save agree exactly: real, they were 0.25 s apart at most."""

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_ranks


class SlowToCapture:
    """The script's state whose state_dict takes 0.3 s (a large EMA copied to the host, say)."""

    def __init__(self, clock) -> None:
        self.clock = clock

    def state_dict(self):
        self.clock.sleep(0.3)
        return {"value": 1}

    def load_state_dict(self, state):
        pass


def _train(rank, world, ckpt_dir):
    import hetrain
    from hetrain.metrics.run_log import log_path, read_lines

    from tests import fake_clock

    with pytest.MonkeyPatch.context() as patch:
        clock = fake_clock.install(patch)
        session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=2)
        net = torch.nn.Linear(4, 2)
        model, opt = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_state("slow", SlowToCapture(clock))
        data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
        for step, (x, y) in enumerate(session.loader(data, global_batch_size=8, seed=0)):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if step == 3:
                break
        session.close()
    lines = list(read_lines(log_path(ckpt_dir, rank)))
    return ([c["blocking_seconds"] for c in lines if c["kind"] == "checkpoint"],
            [s["checkpoint_seconds"] for s in lines if s["kind"] == "step"],
            [c["total_seconds"] for c in lines if c["kind"] == "checkpoint"])


def test_the_reported_blocking_time_includes_capturing_the_state(tmp_path):
    (blocking, held, committed), = run_ranks(_train, 1, str(tmp_path))
    assert blocking == [pytest.approx(0.3, abs=1e-9)] * 2, blocking
    # the time until committed counts from the capture too: it was shorter than the time the loop was held. A
    # background write commits whenever its thread gets there: past the next capture's 0.3 s, or not
    assert len(committed) == 2 and all(c >= 0.3 - 1e-9 for c in committed), committed
    assert held[2] == pytest.approx(blocking[0], abs=1e-9), held   # step 3 pays step 2's save: the two agree
