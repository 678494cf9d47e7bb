"""An evaluation every N steps inside an epoch continues exactly across a restart with the recipe of
docs/checkpoints.md: the checkpoint of an evaluation's step is taken inside `session.step()`, before the
evaluation, so the script keeps the step it last evaluated at in its state and, right after
`session.loader()` resumes, evaluates the resumed step if it is due and was not evaluated."""

import os
import signal

import pytest
import torch
import torch.nn.functional as F

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.runtime.test_refusals import make_data

EVERY = 4   # steps between evaluations, and between checkpoints: each checkpoint is an evaluation's step


def _run(directory, crash=None):
    """2 epochs of 6 steps; evaluations at steps 4, 8, 12 (8 inside epoch 2). `crash`: the script raises after
    step 8 returns, before its evaluation, or gets SIGTERM in step 8 (saved there, exit 143)."""
    import hetrain

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8)])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    held_out = make_data(16).tensors
    with hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=EVERY, async_checkpoints=False) as session:
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        done = session.add_state("evaluation", {"at": 0, "best": float("inf"), "seen": []})
        loader = session.loader(make_data(48), global_batch_size=8, shuffle=True, seed=3)

        def evaluate_if_due():
            if session.step_count % EVERY == 0 and done["at"] != session.step_count:
                net.eval()
                value = session.evaluate(*held_out, F.cross_entropy)
                net.train()
                done["best"] = min(done["best"], value)
                done["seen"].append((session.step_count, value))
                done["at"] = session.step_count

        evaluate_if_due()   # resumed from an evaluation step's checkpoint: that evaluation runs now
        while loader.epoch < 2:
            for x, y in loader:
                if session.step_count == 7 and crash == "SIGTERM in step 8":
                    os.kill(os.getpid(), signal.SIGTERM)
                session.backward(F.cross_entropy(model(x), y))
                if session.step():
                    if session.step_count == 8 and crash == "after step 8":
                        raise RuntimeError("crash")
                    evaluate_if_due()
    return dict(done)


@pytest.mark.parametrize("crash", ["after step 8", "SIGTERM in step 8"])
def test_evaluations_inside_an_epoch_resume_as_the_uninterrupted_run_has_them(tmp_path, crash):
    expected = _run(tmp_path / "whole")
    assert [step for step, _ in expected["seen"]] == [4, 8, 12]
    with pytest.raises((RuntimeError, SystemExit)):
        _run(tmp_path / "resumed", crash=crash)
    assert _run(tmp_path / "resumed") == expected
