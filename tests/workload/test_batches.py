"""What `hetrain profile` feeds a model: keyword inputs (a dict, called as model(**batch), as the runtime
does), and make_input(n) held to n samples."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from hetrain.errors import HetrainError
from hetrain.workload import profile
from hetrain.workload.measure import measure
from hetrain.workload.modules import RunnableModel


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x, mask=None):
        h = self.emb(x)
        return self.head(h if mask is None else h * mask)


def _keywords(n: int) -> dict:
    return {"x": torch.randn(n, 8), "mask": torch.ones(n, 16)}


def test_a_model_with_keyword_inputs_is_profiled_and_timed():
    """make_input returning {"x": ..., "mask": ...} was refused, blaming the model."""
    torch.manual_seed(0)
    model = Keywords()
    prof = profile(model, _keywords(4), name="kw")
    assert prof.flops_per_sample > 0 and prof.params == 8 * 16 + 16 + 16 * 2 + 2
    timed = measure(RunnableModel("kw", model, _keywords), torch.device("cpu"), ["fp32"], [2, 4], repeats=2,
                    budget_s=0.05)
    assert [s.micro_batch for s in timed.steps] == [2, 4] and timed.optimizer_seconds > 0


def test_keyword_inputs_of_different_sizes_are_refused_naming_them():
    with pytest.raises(HetrainError, match=r"different first dimensions \(x: 4, mask: 2\)"):
        profile(Keywords(), {"x": torch.randn(4, 8), "mask": torch.ones(2, 16)})


def test_a_make_input_that_ignores_n_is_refused_naming_the_sizes():
    """make_input always returning 8 samples was timed as micro-batch 64 (34,351 samples/s)."""
    fixed = RunnableModel("fixed", nn.Linear(8, 2), lambda n: torch.randn(8, 8))
    with pytest.raises(HetrainError, match=r"make_input\(64\) of fixed gave a batch of 8 samples, not 64: .*fix "
                                           r"make_input\(n\) to return n samples"):
        measure(fixed, torch.device("cpu"), ["fp32"], [8, 64], repeats=2, budget_s=0.05, blocks=False)


def test_profile_cli_refuses_a_make_input_that_ignores_n_in_one_line(tmp_path):
    script = tmp_path / "fixed.py"
    script.write_text("import torch\n\ndef make_model():\n    return torch.nn.Linear(4, 2), lambda n: torch.randn(8, 4)\n")
    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", "--script", str(script), "--device", "cpu",
                        "--micro-batches", "2", "--seconds", "0.1", "--no-blocks", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "make_input(2) of fixed gave a batch of 8 samples, not 2" in p.stderr


def test_to_device_moves_the_tensors_of_nested_dicts_lists_and_tuples():
    """Nested inputs stayed on the CPU: a model timed on a GPU was given tensors it could not use."""
    from collections import namedtuple

    from hetrain.workload.batches import to_device

    Pair = namedtuple("Pair", "a b")
    t = torch.zeros(4, 3)
    batch = {"x": t, "extra": {"mask": t, "pair": (t, [t, 2])}, "named": Pair(t, "s"), "flag": True}
    moved = to_device(batch, "meta")
    assert moved["x"].is_meta and moved["extra"]["mask"].is_meta
    assert moved["extra"]["pair"][0].is_meta and moved["extra"]["pair"][1][0].is_meta
    assert moved["extra"]["pair"][1][1] == 2 and isinstance(moved["extra"]["pair"], tuple)
    assert isinstance(moved["named"], Pair) and moved["named"].a.is_meta and moved["named"].b == "s"
    assert moved["flag"] is True


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(50, 8), nn.Embedding(6, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, position_ids):
        return self.head(self.tokens(input_ids) + self.positions(position_ids))


def _positions(n: int) -> dict:
    return {"input_ids": torch.randint(0, 50, (n, 6)), "position_ids": torch.arange(6)[None]}


def test_a_keyword_input_of_one_row_every_sample_shares_is_profiled():
    """position_ids of shape [1, T] beside input_ids [n, T] was refused ('different first dimensions'),
    though the runtime gives such a tensor whole to every micro-batch."""
    prof = profile(Positions(), _positions(4), name="pos")
    assert prof.flops_per_sample > 0
    timed = measure(RunnableModel("pos", Positions(), _positions), torch.device("cpu"), ["fp32"], [1, 3], repeats=2,
                    budget_s=0.05, blocks=False)
    assert [s.micro_batch for s in timed.steps] == [1, 3]
    odd = RunnableModel("odd", Positions(), lambda n: {**_positions(n), "position_ids": torch.zeros(2, 6).long()})
    with pytest.raises(HetrainError, match=r"different first dimensions \(input_ids: 3, position_ids: 2\)"):
        odd.batch(3)
    fixed = RunnableModel("fixed", Positions(), lambda n: _positions(1))
    with pytest.raises(HetrainError, match=r"make_input\(3\) of fixed gave a batch of 1 samples, not 3"):
        fixed.batch(3)
