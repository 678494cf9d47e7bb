"""The script's own time between the step's last backward and step() (where a loop logs its loss or accuracy) is
the script's, as after step(): it was reported as waiting on the other ranks. A collective of the session's there
(global_mean) that waits for a slower rank is waiting, not the script's time."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tests.distributed import run_ranks
from tests.metrics.step_records import StepRecords

SLEEP_S = 0.1   # large beside a loaded machine's scheduling (at 0.03 s, bounds 0.1-0.17 s off in all)
STEPS = 12


def _train(rank: int, world: int, sleepers: tuple[int, ...], mean_before_step: bool,
           mean_in_compute: bool = False) -> dict[str, float]:
    import hetrain

    session = hetrain.Session()
    net = torch.nn.Linear(16, 4)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = StepRecords()
    session.add_observer(seen)
    data = torch.utils.data.TensorDataset(torch.randn(24 * (STEPS + 1), 16), torch.randint(0, 4, (24 * (STEPS + 1),)))
    for x, y in session.loader(data, global_batch_size=24):
        loss = F.cross_entropy(model(x), y)
        if mean_in_compute:   # between the forward and its backward (docs/porting.md, two means of one batch)
            if rank in sleepers:
                time.sleep(SLEEP_S)   # a slower rank's forward
            session.global_mean(torch.tensor(float(len(y))), weight=len(y))
        session.backward(loss)
        if rank in sleepers and not mean_in_compute:
            time.sleep(SLEEP_S)   # the script's logging, before step()
        if mean_before_step:
            session.global_mean(loss.detach())
        session.step()
        if session.step_count >= STEPS:
            break
    session.close()
    return seen.totals(SLEEP_S if rank in sleepers else 0.0)


def test_time_before_step_is_the_script_s_on_a_balanced_job():
    for figures in run_ranks(_train, 2, (0, 1), False):
        assert figures["script"] >= 0.8 * figures["slept"], figures
        assert figures["ranks"] < 0.5 * figures["slept"], figures


def test_a_wait_in_global_mean_before_step_is_the_ranks_not_the_script_s():
    waiting, sleeping = run_ranks(_train, 2, (1,), True)
    slept = sleeping["slept"]
    assert sleeping["script"] >= 0.8 * slept and sleeping["ranks"] < 0.5 * slept, sleeping
    assert waiting["ranks"] >= 0.5 * slept and waiting["script"] < 0.5 * slept, waiting


def test_a_wait_in_global_mean_between_forward_and_backward_is_the_ranks_not_compute():
    """The faster rank's wait there for the slower one's forward was timed as its own compute: the balancer saw
    both ranks equally slow (0.052 s of compute each, where the faster computed 0.002 s; found in review)."""
    waiting, sleeping = run_ranks(_train, 2, (1,), False, True)
    slept = sleeping["slept"]
    assert sleeping["compute"] >= 0.8 * slept, sleeping
    assert waiting["ranks"] >= 0.5 * slept and waiting["compute"] < 0.5 * slept, waiting
