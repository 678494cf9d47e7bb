"""int8 and top-k carry what they leave out to the next step: nothing of the gradient is lost."""

import torch
import torch.distributed as dist

from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import build_comm_hook
from tests.distributed import run_ranks

NUMEL = 3000
STEPS = 12


class _Bucket:
    """The part of dist.GradBucket the hooks read."""

    def __init__(self, tensor: torch.Tensor, params: list) -> None:
        self._t, self._params = tensor, params

    def buffer(self) -> torch.Tensor:
        return self._t

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list:
        return self._params

    def gradients(self) -> list:
        return [self._t]


def _gather_cat(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def _sums(rank: int, world: int, compression: str) -> dict:
    """Sum of what the hook applied, sum of the true averages, and what the residuals still hold."""
    dist.init_process_group("gloo")
    state, hook = build_comm_hook(CommPlan(compression=compression, topk_ratio=0.05))
    params = [torch.nn.Parameter(torch.zeros(1))]
    applied = torch.zeros(NUMEL, dtype=torch.float64)
    true = torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(STEPS):
        g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank)) * (1 + step % 3)
        true += _gather_cat(g.clone()).view(world, NUMEL).double().mean(0)
        out = hook(state, _Bucket(g.clone(), params)).wait()
        applied += out.double()
    inner = state.inner
    held = _gather_cat(inner.residual[0]).view(world, NUMEL).double().mean(0)
    if compression == "int8":  # each rank also holds the re-quantisation residual of its shard
        held += _gather_cat(inner.shard_residual[0]).double()[:NUMEL]
    return {"applied": applied, "true": true, "held": held}


def _constant_small(rank: int, world: int, compression: str) -> dict[bool, torch.Tensor]:
    """Mean applied update over many steps of a gradient whose small entries are never sent alone.

    int8: 1e-3 beside 1.0 in the same chunk rounds to 0. topk at 1% of 1000 (k=10): five entries
    of 1.0 and 995 of about 0.01 (distinct), so only the five largest small ones make the cut.
    """
    dist.init_process_group("gloo")
    params = [torch.nn.Parameter(torch.zeros(1))]
    if compression == "int8":
        g = torch.full((1000,), 1e-3)
        g[0] = 1.0
    else:
        g = 0.01 + 1e-6 * torch.arange(1000.0)
        g[:5] = 1.0
    means = {}
    for error_feedback in (True, False):
        state, hook = build_comm_hook(CommPlan(compression=compression, topk_ratio=0.01))
        state.inner.error_feedback = error_feedback
        total = torch.zeros(1000)
        steps = 300
        for _ in range(steps):
            total += hook(state, _Bucket(g.clone(), params)).wait()
        means[error_feedback] = total / steps
    return means


def test_int8_residuals_account_for_every_bit_left_out():
    for r in run_ranks(_sums, 2, "int8"):
        assert torch.allclose(r["applied"] + r["held"], r["true"], atol=1e-5)
        assert r["held"].abs().max() > 0  # something was carried


def test_topk_residuals_account_for_every_value_left_out():
    for r in run_ranks(_sums, 2, "topk"):
        assert torch.allclose(r["applied"] + r["held"], r["true"], atol=1e-5)
        assert r["held"].abs().max() > 0.5  # 95% of each step is carried, not dropped


def test_int8_error_feedback_delivers_entries_too_small_to_send_alone():
    means = run_ranks(_constant_small, 2, "int8")[0]
    with_ef, without = means[True], means[False]
    assert torch.all(without[1:500] == 0)  # the chunk of rank 0's shard that holds the 1.0
    assert torch.allclose(with_ef[1:], torch.full((999,), 1e-3), atol=1e-4)
    assert abs(with_ef[0] - 1.0) < 1e-3


def test_topk_error_feedback_sends_every_entry_in_turn():
    means = run_ranks(_constant_small, 2, "topk")[0]
    with_ef, without = means[True], means[False]
    assert torch.count_nonzero(without) == 10  # the same ten entries every step
    assert torch.count_nonzero(with_ef) == 1000
