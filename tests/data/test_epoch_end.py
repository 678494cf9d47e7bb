"""`while loader.epoch < epochs: for batch in loader:` runs exactly `epochs` epochs however the pass is
left: a break at the last step, or a resume from a checkpoint saved at the last step."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from tests.distributed import run_ranks

EPOCHS, SAMPLES, GLOBAL = 2, 64, 16   # 4 steps an epoch


def _session(ckpt_dir, interval):
    """A session checkpointing to `ckpt_dir` every `interval` steps, its linear model and its loader."""
    import hetrain

    session = hetrain.Session(checkpoint_dir=ckpt_dir, checkpoint_interval=interval, async_checkpoints=False)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 4, generator=g), torch.randint(0, 2, (SAMPLES,), generator=g))
    return session, net, model, session.loader(data, global_batch_size=GLOBAL, shuffle=True, seed=0)


def _loop(rank, world, ckpt_dir, break_every):
    session, net, model, loader = _session(ckpt_dir, 4)
    seen = [(loader.epoch, loader.step_in_epoch)]
    while loader.epoch < EPOCHS:
        for x, y in loader:
            seen.append(loader.epoch)
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if break_every and session.step_count % break_every == 0:
                break   # e.g. evaluate every few steps, then go on
    session.close()
    return session.step_count, seen, [p.detach().clone() for p in net.parameters()]


def test_a_break_at_each_epochs_last_step_does_not_add_an_epoch(tmp_path):
    steps, seen, _ = run_ranks(_loop, 2, None, 4)[0]
    assert steps == 8 and seen == [(0, 0), 0, 0, 0, 0, 1, 1, 1, 1], seen


def test_a_resume_from_the_last_steps_checkpoint_trains_nothing_more(tmp_path):
    steps, _, params = run_ranks(_loop, 2, str(tmp_path), 0)[0]
    assert steps == 8
    again, seen, resumed = run_ranks(_loop, 2, str(tmp_path), 0)[0]
    # the run had ended: the loop does not start another epoch (its close() saved step 8 again once the loop had
    # gone past the epoch's end: a resume from the in-step checkpoint would run that end again)
    assert again == 8 and seen == [(2, 0)], seen
    assert all(torch.equal(a, b) for a, b in zip(params, resumed))


def _stop_mid_epoch(rank, world, ckpt_dir, samples, shuffle, steps):
    import hetrain

    session = hetrain.Session(checkpoint_dir=ckpt_dir, checkpoint_interval=2, async_checkpoints=False)
    net = torch.nn.Linear(4, 2)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(samples, 4), torch.randint(0, 2, (samples,)))
    try:
        loader = session.loader(data, global_batch_size=GLOBAL, shuffle=shuffle, seed=0)
    except Exception as e:   # noqa: BLE001 - the refusal is what is checked
        session.close()
        return str(e)
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if session.step_count == steps:
            break
    session.close()
    return loader.epoch, loader.step_in_epoch


def test_a_resume_mid_epoch_with_the_data_ordered_differently_is_refused(tmp_path):
    assert run_ranks(_stop_mid_epoch, 1, str(tmp_path), SAMPLES, True, 2)[0] == (0, 2)
    message = run_ranks(_stop_mid_epoch, 1, str(tmp_path), SAMPLES, False, 3)[0]
    assert "stopped in the middle of epoch 0" in message and "shuffle True -> False" in message, message
    message = run_ranks(_stop_mid_epoch, 1, str(tmp_path), SAMPLES + 16, True, 3)[0]
    assert "samples 64 -> 80" in message and "change them at an epoch's end" in message, message
    # at an epoch's end the next epoch may be ordered anew
    assert run_ranks(_stop_mid_epoch, 1, str(tmp_path), SAMPLES, True, 4)[0] == (1, 0)
    assert run_ranks(_stop_mid_epoch, 1, str(tmp_path), SAMPLES + 16, False, 6)[0] == (1, 2)


def _peek_after(rank, world, ckpt_dir, epochs, peek):
    """`epochs` epochs, then rank 0 alone reads the loader (a batch to log predictions on, or a whole pass)."""
    session, net, model, loader = _session(ckpt_dir, 100)
    start = (loader.epoch, loader.step_in_epoch)
    while loader.epoch < epochs:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
    if rank == 0 and peek == "batch":
        next(iter(loader))
    elif rank == 0 and peek == "pass":
        for _ in loader:
            pass
    session.close()   # saves the last step
    return start, session.step_count, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("peek", ["batch", "pass"])
def test_batches_rank_0_reads_after_the_last_step_are_not_skipped_by_the_resume(tmp_path, peek):
    """The closing save took rank 0's loader position: the resume began at step 1 of the next epoch (a peeked
    batch never trained) or an epoch later (a pass that only read), silently."""
    _, _, want = run_ranks(_peek_after, 2, None, 3, None)[0]
    run_ranks(_peek_after, 2, str(tmp_path), 2, peek)
    start, steps, params = run_ranks(_peek_after, 2, str(tmp_path), 3, None)[0]
    assert start == (2, 0) and steps == 12, (start, steps)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, want))
