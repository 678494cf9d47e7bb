"""What `hetrain profile` feeds a model: keyword inputs (a dict, called as model(**batch), as the runtime
does)."""

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
