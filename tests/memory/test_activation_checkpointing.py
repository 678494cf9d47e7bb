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


class _NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.inorm = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.InstanceNorm1d(8, track_running_stats=True)

    def forward(self, x):
        return x + self.bn(self.fc(x)) + self.inorm(x[:, None, :].expand(-1, 8, -1)).mean(-1)


def test_a_recomputed_block_updates_running_statistics_once():
    """The recompute in backward ran BatchNorm's forward again: the count doubled (12 after 6 steps) and
    the running mean and variance moved twice, beside the same weights."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[_NormBlock() for _ in range(3)])
    ckpt = nn.Sequential(*[_NormBlock() for _ in range(3)])
    ckpt.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(ckpt)
    for step in range(6):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        for model in (plain, ckpt):
            model(x).square().mean().backward()
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), name
    assert ckpt[0].bn.num_batches_tracked.item() == 6
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)


def test_ranks_run_equal_micro_batch_counts_where_every_forward_runs_a_collective():
    """SyncBatchNorm (CUDA ranks) gathers statistics in every forward, as FSDP2 gathers weights: a rank
    with fewer micro-batches than another would pair its gradient all-reduce with their statistics."""
    from hetrain.runtime.parallelize import equal_piece_counts

    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert not equal_piece_counts(plain, "none", None) and equal_piece_counts(plain, "fsdp", None)
    assert equal_piece_counts(synced, "none", None) and equal_piece_counts(synced, "zero1", None)
    assert not equal_piece_counts(synced, "none", layout=object())   # pipeline stages keep their own schedule


def test_a_checkpointed_block_with_running_statistics_compiles_and_counts_once():
    """The recompute's context (which keeps running statistics) failed torch.compile's check."""
    torch.manual_seed(0)
    model = nn.Sequential(_NormBlock(), _NormBlock())
    apply_activation_checkpointing(model)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(4, 8)).square().mean().backward()
    assert [b.bn.num_batches_tracked.item() for b in model] == [1, 1]


class _CountingBlock(nn.Module):
    """A block whose forward reads and writes its own buffers: spectral_norm's power iteration, and a counter
    that scales the output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x + torch.tanh(self.fc(x)) * (1.0 + 0.1 * self.calls)


def test_a_recomputed_block_sees_its_buffers_as_the_forward_did():
    """The recompute ran with the buffers the forward had already updated (the power iteration moved on, the
    counter counted twice): another forward's gradient (2.7e-05 off with spectral_norm) and buffers moved
    twice (a counter of 8 after 4 steps)."""
    ckpt = _recomputes_as_the_forward_ran(_CountingBlock)
    assert [b.calls.item() for b in ckpt] == [4.0, 4.0]


def _recomputes_as_the_forward_ran(make_block) -> nn.Module:
    """Four steps of two blocks with and without activation checkpointing: the same gradients each step and
    the same buffers after each; returns the checkpointed model."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[make_block() for _ in range(2)])
    ckpt = nn.Sequential(*[make_block() for _ in range(2)])
    ckpt.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(ckpt)
    for step in range(4):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        for model in (plain, ckpt):
            model.zero_grad()
            model(x).square().mean().backward()
        for a, b in zip(plain.parameters(), ckpt.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7)
        for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
            assert torch.equal(a, b), (step, name)
    return ckpt


class _SometimesBlock(nn.Module):
    """A block whose forward writes its buffer only on every second call, in training mode."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("phase", torch.zeros(8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        if self.training and int(self.calls) % 2 == 0:
            with torch.no_grad():
                self.phase.add_(x.mean(0))
        return torch.tanh(self.fc(x)) * torch.cos(self.phase)


def test_a_buffer_written_on_some_forwards_only_is_restored_by_every_recompute():
    """The recompute once copied only the buffers a block's first forward wrote: one written every second
    forward was updated again by the recompute (gradients 0.52 off, buffers 0.19)."""
    _recomputes_as_the_forward_ran(_SometimesBlock)
