"""Pipelines on models and losses off the common path: each gives the update of one process."""

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from tests.distributed import run_ranks
from tests.pipeline.common import CLASSES, FEATURES, LR, count_labels, make_model, pipeline_plan

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
