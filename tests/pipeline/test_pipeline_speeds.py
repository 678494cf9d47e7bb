"""Emulated speeds on pipeline stages: a CPU rank standing in for a slower device pads its stage's compute."""

import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from tests.distributed import run_ranks
from tests.pipeline.common import pipeline_plan

# WAIT is large beside the machine's scheduling: at 0.005 s a block, the fast stage's bound of 2.5 x its
# forwards was 0.06 s a step above them, which one late wake-up of a loaded machine takes
WAIT, BLOCKS, MICRO = 0.03, 2, 4


class Slow(nn.Module):
    """A block whose forward takes at least WAIT seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(WAIT)
        return self.fc(x)


def _compute_seconds(rank, world):
    import hetrain

    plan = pipeline_plan([[0, BLOCKS], [BLOCKS, 2 * BLOCKS]], "1f1b", microbatches=MICRO, global_batch=8)
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = nn.Sequential(*[Slow() for _ in range(2 * BLOCKS)])
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 4))
    for x, y in session.loader(data, global_batch_size=8, shuffle=False):
        session.forward_backward(x, y, F.mse_loss)
        session.step()
        if session.step_count == 3:
            break
    session.close()
    return list(session.compute_seconds)


def test_a_stage_at_a_quarter_speed_computes_four_times_as_long():
    fast, slow = run_ranks(_compute_seconds, 2, env={"HETRAIN_EMULATE_SPEEDS": "1,0.25"})
    floor = MICRO * BLOCKS * WAIT             # each stage's forwards alone, per step
    assert len(slow) == 2 and all(t >= 4 * floor for t in slow), slow
    assert all(floor <= t < 2.5 * floor for t in fast), fast
