"""Pipelines on models and losses off the common path: each gives the update of one process."""

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from tests.distributed import run_ranks
from tests.pipeline.common import (CLASSES, FEATURES, LR, WIDTH, Block, count_labels, make_data, make_model,
                                   pipeline_plan)

GLOBAL = 8


def masked_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A hand-written token mean: over no tokens it is 0/0, and its backward NaN."""
    mask = y != -100
    return (F.cross_entropy(logits, y.clamp(min=0), reduction="none") * mask).sum() / mask.sum()


def _labels_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, FEATURES, generator=g), torch.randint(0, CLASSES, (16,), generator=g)
    y[0:2] = -100   # the first step's first micro-batch (2 samples) has no items
    return TensorDataset(x, y)


def _train_masked(rank: int, world: int, plan, steps: int) -> dict:
    import hetrain

    session = hetrain.Session(plan)
    net = make_model(4)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    applied = []
    for x, y in session.loader(_labels_data(), global_batch_size=GLOBAL, shuffle=False):
        session.forward_backward(x, y, masked_mean, num_items=count_labels)
        applied.append(session.step())
        if session.step_count == steps:
            break
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    session.close()
    return {"applied": applied, "state": state}


def test_a_micro_batch_without_items_under_a_hand_written_token_mean():
    """Its zeros go through the logits the loss took: the step was skipped for NaN gradients (0.149 off) before."""
    model, steps = make_model(4), 2
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _labels_data().tensors
    for s in range(steps):
        masked_mean(model(x[s * GLOBAL:(s + 1) * GLOBAL]), y[s * GLOBAL:(s + 1) * GLOBAL]).backward()
        opt.step()
        opt.zero_grad()
    plan = pipeline_plan([[0, 3], [3, 6]], "1f1b", microbatches=4, global_batch=GLOBAL)
    results = run_ranks(_train_masked, 2, plan, steps)
    assert all(r["applied"] == [True, True] for r in results)
    want = model.state_dict()
    assert max((v - want[k]).abs().max().item() for r in results for k, v in r["state"].items()) < 1e-5


def _batchnorm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.BatchNorm1d(WIDTH), Block(), nn.Linear(WIDTH, CLASSES))


def _batchnorm_data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, FEATURES, generator=g)
    x[4:8] += 3.0   # the second replica's samples of each global batch: other statistics
    x[12:16] += 3.0
    return TensorDataset(x, torch.randint(0, CLASSES, (32,), generator=g))


def _train_batchnorm(rank: int, world: int, plan, steps: int) -> dict:
    import hetrain

    session = hetrain.Session(plan)
    net = _batchnorm_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    for x, y in session.loader(_batchnorm_data(), global_batch_size=GLOBAL, shuffle=False):
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        if session.step_count == steps:
            break
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    session.close()
    return state


def test_batchnorm_statistics_are_one_over_the_replicas():
    """2 stages x 2 replicas, BatchNorm in stage 0: each stage's buffers are its first replica's after every step,
    as data parallelism keeps rank 0's (the replicas drifted apart before), and torch's first-step shape
    inference leaves them as they were (it counted a forward more: a resumed run differed)."""
    steps, micro = 2, 2
    model = _batchnorm_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _batchnorm_data().tensors
    for s in range(steps):
        start = {k: v.clone() for k, v in model.named_buffers()}
        for replica in (1, 0):   # replica 1's forwards first: replica 0's statistics are the ones kept
            if replica == 0:
                model.load_state_dict(start, strict=False)
            for m in range(2):
                rows = slice(s * GLOBAL + replica * 4 + m * micro, s * GLOBAL + replica * 4 + (m + 1) * micro)
                (F.cross_entropy(model(x[rows]), y[rows]) * micro / GLOBAL).backward()
        opt.step()
        opt.zero_grad()
    plan = pipeline_plan([[0, 2], [2, 4]], "gpipe", microbatches=2, global_batch=GLOBAL, replica_shares=[4, 4])
    results = run_ranks(_train_batchnorm, 4, plan, steps)
    assert all(torch.equal(v, results[2][k]) for k, v in results[0].items())
    assert int(results[0]["1.num_batches_tracked"]) == steps * micro
    want = model.state_dict()
    assert max((v.float() - want[k].float()).abs().max().item() for r in results for k, v in r.items()) < 1e-5


def _stages_without_parameters() -> nn.Sequential:
    """Stage 1 holds an activation only (no state at all), stage 2 a BatchNorm's running statistics only."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.BatchNorm1d(WIDTH, affine=False),
                         nn.Linear(WIDTH, CLASSES))


def _train_without_parameters(rank: int, world: int, plan, steps: int, checkpoint_dir: str) -> tuple:
    import hetrain

    session = hetrain.Session(plan, checkpoint_dir=checkpoint_dir, checkpoint_interval=2, async_checkpoints=False)
    net = _stages_without_parameters()
    session.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    loader = session.loader(_batchnorm_data(), global_batch_size=GLOBAL, shuffle=False)   # resumes
    started_at = session.step_count
    while session.step_count < steps:
        for x, y in loader:
            session.forward_backward(x, y, F.cross_entropy)
            session.clip_grad_norm_(1.0)
            session.step()
            if session.step_count == steps:
                break
    whole = session.model_state_dict()
    session.close()
    return whole, started_at


def test_stages_without_parameters_save_resume_and_export(tmp_path):
    """A stage of an activation, one of buffers only: checkpoints, a resume as exact as the run not stopped, and
    model_state_dict() (torch's 'model state_dict is empty', then 'optim state_dict is empty', on those ranks)."""
    plan = pipeline_plan([[0, 1], [1, 2], [2, 3], [3, 4]], "1f1b", microbatches=4, global_batch=GLOBAL)
    whole, _ = run_ranks(_train_without_parameters, 4, plan, 4, str(tmp_path / "whole"))[0]
    run_ranks(_train_without_parameters, 4, plan, 2, str(tmp_path / "stopped"))
    resumed, started_at = run_ranks(_train_without_parameters, 4, plan, 4, str(tmp_path / "stopped"))[0]
    assert started_at == 2
    assert set(whole) == set(_stages_without_parameters().state_dict())
    assert all(torch.equal(v, resumed[k]) for k, v in whole.items())
    assert not torch.equal(whole["0.weight"], _stages_without_parameters()[0].weight.detach())   # it trained


def _evaluate_counted(rank: int, world: int, plan) -> float:
    import hetrain

    session = hetrain.Session(plan)
    net = make_model(4)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    x, y = make_data(ignored=True)[rank * 6:(rank + 1) * 6]
    model.eval()
    loss = session.evaluate(x, y, F.cross_entropy, num_items=int(count_labels(y)))   # this rank's part's items
    session.close()
    return loss


def test_evaluate_takes_each_ranks_items_as_a_number():
    """As under data parallelism (and docs/runtime.md): the replica's batch runs as one micro-batch, weighted by
    its ranks' numbers (refused with 'pass a function' before)."""
    plan = pipeline_plan([[0, 3], [3, 6]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[4, 4])
    x, y = make_data(ignored=True)[:24]
    with torch.no_grad():
        want = F.cross_entropy(make_model(4)(x), y).item()   # the token mean over every rank's items
    assert all(abs(loss - want) < 1e-5 for loss in run_ranks(_evaluate_counted, 4, plan))
