"""Measured profiles count what torch counts; analytic profiles agree with the published facts."""

import pytest
import torch
from torch import nn

from hetrain.errors import HetrainError
from hetrain.workload import WorkloadProfile, get_profile, profile


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_profile_counts_flops_activations_and_blocks(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    prof = profile(model, torch.randn(8, 32), name="tiny")
    macs = 32 * 64 + 3 * 64 * 64 + 64 * 10
    # forward 2*MACs, backward 4*MACs except the first layer's input gradient (2*MACs less)
    assert prof.flops_per_sample == pytest.approx(6 * macs - 2 * 32 * 64, rel=1e-6)
    assert [b.name for b in prof.blocks] == ["inp", "layers.0", "layers.1", "layers.2", "head"]
    assert sum(b.params for b in prof.blocks) == prof.params == sum(p.numel() for p in model.parameters())
    assert sum(b.flops_per_sample for b in prof.blocks) == pytest.approx(prof.flops_per_sample)
    # each hidden linear saves its 64-float input; relu saves its output
    assert prof.blocks[1].activation_bytes_per_sample >= 64 * 4
    assert prof.activation_bytes_per_sample >= sum(b.activation_bytes_per_sample for b in prof.blocks)
    assert prof.blocks[1].output_bytes_per_sample == 64 * 4
    path = tmp_path / "p.json"
    prof.save(path)
    assert WorkloadProfile.load(path) == prof
    assert all(p.grad is None for p in model.parameters())


def test_activation_bytes_grow_with_depth_not_with_batch():
    a = profile(Tiny(), torch.randn(4, 32))
    b = profile(Tiny(), torch.randn(16, 32))
    assert a.activation_bytes_per_sample == pytest.approx(b.activation_bytes_per_sample, rel=0.05)


def test_load_missing_or_bad_profile(tmp_path):
    with pytest.raises(HetrainError, match="does not exist"):
        WorkloadProfile.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(HetrainError, match="is not a workload profile"):
        WorkloadProfile.load(bad)


@pytest.mark.parametrize("name,params_m,blocks", [("resnet50", 25.56, 6), ("resnet152", 60.19, 6),
                                                   ("bert-large", 335.1, 26), ("gpt2-1.5b", 1558, 50)])
def test_zoo_profiles_agree_with_published_facts(name, params_m, blocks):
    p = get_profile(name)
    assert sum(b.params for b in p.blocks) == pytest.approx(params_m * 1e6, rel=0.002)
    assert len(p.blocks) == blocks
    assert sum(b.flops_per_sample for b in p.blocks) == pytest.approx(p.flops_per_sample, rel=1e-6)


def test_zoo_sequence_variants_and_unknown_name():
    assert get_profile("bert-large-512").seq_len == 512 and get_profile("bert-large").seq_len == 128
    assert get_profile("bert-large-512").flops_per_sample == pytest.approx(3 * 335.0e9)
    with pytest.raises(HetrainError, match="unknown model"):
        get_profile("resnet9000")
