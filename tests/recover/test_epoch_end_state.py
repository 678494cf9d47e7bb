"""A run resumed from the checkpoint of an epoch's last step runs the script's epoch-end code again.

A loop steps a schedule once an epoch, evaluates (drawing from the generators), keeps a best value: code
after the epoch's last `session.step()`. The step's checkpoint (periodic, or a SIGTERM's) is taken inside
that step, before such code; a run resumed from it began the next epoch and never ran it, so the schedule
step, the best value and the generators' draws were lost. The resumed loop's first pass over the loader now
yields no batch, and the code after it runs as it did in the uninterrupted run (`session.loss` is the
checkpoint's step's)."""

import os
import signal

import pytest
import torch
import torch.nn.functional as F

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.runtime.test_refusals import make_data

EPOCHS = 3
ENDS = []   # the epoch ends each run ran: (directory, epoch)


def _run(directory, crash=None):
    """3 epochs of 4 steps, a checkpoint every 4 steps (each at an epoch's last step); the epoch's end steps
    a MultiStepLR saved with add_state and draws from the generator dropout uses. `crash`: the script raises
    after step 8 or in epoch 1's end, or gets SIGTERM in step 8 (saved there, exit 143)."""
    import hetrain

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8)])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    with hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=4, async_checkpoints=False) as session:
        model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        schedule = session.add_state("schedule", torch.optim.lr_scheduler.MultiStepLR(optimizer, [1, 2], 0.5))
        best = session.add_state("best", {"loss": float("inf"), "noise": 0.0})
        loader = session.loader(make_data(), global_batch_size=8, shuffle=True, seed=3)
        while loader.epoch < EPOCHS:
            for x, y in loader:
                if session.step_count == 7 and crash == "SIGTERM in step 8":
                    os.kill(os.getpid(), signal.SIGTERM)
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                if session.step_count == 8 and crash == "after step 8":
                    raise RuntimeError("crash")
            ENDS.append((str(directory), loader.epoch))
            schedule.step()
            if session.step_count == 8 and crash == "at epoch 1's end":
                raise RuntimeError("crash")
            best["loss"] = min(best["loss"], session.loss)
            best["noise"] += float(torch.rand(()))   # an evaluation's random crop: the generator moves
        params = [p.detach().clone() for p in net.parameters()]
    return params, optimizer.param_groups[0]["lr"], dict(best)


@pytest.mark.parametrize("crash", ["after step 8", "at epoch 1's end", "SIGTERM in step 8"])
def test_a_run_resumed_from_an_epochs_last_step_equals_an_uninterrupted_one(tmp_path, crash):
    """Each resumes from step 8's checkpoint, taken inside the step (a failing close saves nothing at an epoch's
    end: it would hold part of the epoch's end code)."""
    expected, lr, best = _run(tmp_path / "whole")
    with pytest.raises((RuntimeError, SystemExit)) as stopped:
        _run(tmp_path / "resumed", crash=crash)
    assert crash != "SIGTERM in step 8" or stopped.value.code == 143
    resumed, resumed_lr, resumed_best = _run(tmp_path / "resumed")
    assert resumed_lr == lr == 0.025 and resumed_best == best
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected))


def test_a_finished_run_launched_again_runs_no_epoch_end_again(tmp_path):
    """Its last checkpoint, of its last step (an epoch's), was taken inside the step: launched again, the run
    ran that epoch's end code once more (its evaluation, a best-model file written again). close() saves the
    step again once the loop has gone past the epoch's end."""
    expected, lr, best = _run(tmp_path)
    assert [e for d, e in ENDS if d == str(tmp_path)] == [1, 2, 3]
    again, again_lr, again_best = _run(tmp_path)
    assert [e for d, e in ENDS if d == str(tmp_path)] == [1, 2, 3]   # nothing ran again
    assert (again_lr, again_best) == (lr, best) and all(torch.equal(a, b) for a, b in zip(again, expected))
