"""A schedule the loop steps once an epoch, kept through `session.add_state`, resumes with the learning rate the
checkpoint's optimizer had, whether it is built before or after `session.loader()` (built after, its construction
set the lr to the schedule's start, and loading its state left it there: a run resumed in its third epoch said
0.49 and trained at 1.0)."""

import pytest
import torch
import torch.nn.functional as F

from tests.runtime.test_refusals import make_data, make_net

EPOCHS = 4   # 4 steps an epoch (32 samples, 8 a step)


def _run(directory, stop_at, given, schedule):
    """Train EPOCHS epochs (resuming what `directory` holds), or stop after step `stop_at`; returns the lr and
    momentum each step ran with and the parameters."""
    import hetrain

    session = hetrain.Session(checkpoint_dir=directory, checkpoint_interval=3, async_checkpoints=False)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    if given == "before":
        scheduler = session.add_state("lr_schedule", schedule(optimizer))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=True, seed=0)
    if given == "after":   # as a script that takes the schedule's length from len(loader) builds it
        scheduler = session.add_state("lr_schedule", schedule(optimizer))
    seen = []
    while loader.epoch < EPOCHS:
        for x, y in loader:
            seen.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["momentum"]))
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count == stop_at:
                session.close()   # saves this step, mid-epoch
                return seen, None
        scheduler.step()   # the loop's own, once an epoch
    params = [p.detach().clone() for p in session.prepared.module.parameters()]
    session.close()
    return seen, params


def _decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.7 ** epoch)


def _cycle(optimizer):   # moves momentum too
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=EPOCHS + 1)


@pytest.mark.parametrize("schedule", [_decay, _cycle])
@pytest.mark.parametrize("given", ["before", "after"])
def test_an_epoch_schedule_kept_as_the_scripts_state_resumes_with_the_checkpoints_lr(tmp_path, given, schedule):
    straight, end = _run(str(tmp_path / "a"), None, given, schedule)
    first, _ = _run(str(tmp_path / "b"), 10, given, schedule)   # stops in the third epoch
    resumed, end_resumed = _run(str(tmp_path / "b"), None, given, schedule)
    assert len(straight) == 16 and len({s for s in straight}) == EPOCHS   # one setting an epoch
    assert first + resumed == straight
    assert all(torch.equal(a, b) for a, b in zip(end, end_resumed, strict=True))
