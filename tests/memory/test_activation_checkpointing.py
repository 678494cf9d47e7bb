"""Activation checkpointing keeps block inputs only: at least half the saved bytes, the same loss."""

import pytest
import torch
from torch import nn

from hetrain.errors import HetrainError
from hetrain.runtime.memory import SavedActivations, apply_activation_checkpointing, find_blocks
from tests.memory.models import make_data, make_model


def _run(checkpointing: bool):
    model = make_model(width=32, depth=6)
    blocks = apply_activation_checkpointing(model) if checkpointing else find_blocks(model)
    x, y = make_data().tensors
    meter = SavedActivations(model, blocks)
    with meter.measure():
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return meter.bytes, loss.item(), [p.grad for p in model.parameters()], blocks


def test_checkpointing_halves_saved_bytes_with_the_same_loss_and_gradients():
    plain, loss, grads, blocks = _run(False)
    ckpt, loss_ckpt, grads_ckpt, _ = _run(True)
    assert len(blocks) == 6
    assert ckpt * 2 <= plain, (plain, ckpt)
    # What stays is each block's input (48 x 32 fp32) plus what embed and head save.
    assert ckpt >= 6 * 48 * 32 * 4
    assert loss_ckpt == loss
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_checkpointing_keeps_parameter_names():
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == list(make_model().state_dict())


def test_model_without_repeated_blocks_needs_them_named():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(HetrainError, match="blocks="):
        apply_activation_checkpointing(model)
    assert len(apply_activation_checkpointing(model, [model[0], model[2]])) == 2
    with pytest.raises(HetrainError, match="not a submodule"):
        apply_activation_checkpointing(model, [nn.Linear(2, 2)])
