"""session.clip_grad_norm_ under a plan with an fp16 rank: the global-batch norm and the clipped update,
under DDP, ZeRO-1 and FSDP2, equal one process computing each rank's slice in that rank's precision."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.data import GlobalBatchOrder, rank_slice
from tests.precision.plain import PlainLossScale, plain_autocast
from tests.distributed import run_ranks

PRECISIONS = ["fp32", "fp16", "bf16"]
SHARES = [5, 2, 1]
GLOBAL = sum(SHARES)
MAX_NORM = 0.05
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def make_data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def reference():
    net, data = Net(), make_data()
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = PlainLossScale(enabled=True)
    order = GlobalBatchOrder(len(data), GLOBAL, shuffle=True, seed=2)
    norms, history = [], []
    for step in range(STEPS):
        batch = order.global_batch(0, step)
        total = [torch.zeros_like(p) for p in params]
        for r, prec in enumerate(PRECISIONS):
            x, y = data[rank_slice(batch, SHARES, r)]
            with plain_autocast(prec):
                loss = F.cross_entropy(net(x), y)
            # each rank's weight (share * world / global), averaged over the world as the all-reduce does
            grads = torch.autograd.grad((scaler.scale * loss * (SHARES[r] * 3 / GLOBAL)), params)
            total = [t + g / 3 for t, g in zip(total, grads)]
        for p, t in zip(params, total):
            p.grad = t / scaler.scale
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in params])
    return norms, history


def _train(rank, world, sharding):
    import hetrain

    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, precision=p) for r, (s, p) in enumerate(zip(SHARES, PRECISIONS))])
    session = hetrain.Session(plan)
    net = Net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=1.0))
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=2)
    norms, history = [], []
    for x, y in loader:
        with session.autocast():
            loss = F.cross_entropy(model(x), y)
        session.backward(loss)
        norms.append(session.clip_grad_norm_(MAX_NORM).item())
        assert session.step()
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        history.append([p.detach().clone() for p in full])
        if session.step_count == STEPS:
            break
    session.close()
    return norms, history


@pytest.mark.parametrize("sharding", ["none", "zero1", "fsdp"])
def test_clip_grad_norm_with_an_fp16_rank(sharding):
    want_norms, want = reference()
    assert all(n > MAX_NORM for n in want_norms)       # clipping is active at every step
    results = run_ranks(_train, 3, sharding)
    for rank, (norms, history) in enumerate(results):
        for step in range(STEPS):
            assert abs(norms[step] - want_norms[step]) < 1e-5 * max(1.0, want_norms[step]), (rank, step)
            worst = max((g - w).abs().max().item() for g, w in zip(history[step], want[step]))
            assert worst < 1e-5, (sharding, rank, step, worst)
    assert results[0][0] == results[1][0] == results[2][0]   # the same norm on every rank


def _nan_at(rank, world, precision, where="loss"):
    import hetrain
    from tests.log_lines import hetrain_warnings

    plan = Plan(global_batch_size=4, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=2, precision=precision) for r in range(world)])
    session = hetrain.Session(plan)
    net = Net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=4, shuffle=False)
    applied, norms = [], []
    with hetrain_warnings() as warnings:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            if session.step_count == 2 and rank == 1:
                if where == "loss":
                    loss = loss * float("nan")
                else:   # a finite loss whose backward is not: sqrt's slope at 0
                    loss = loss + torch.sqrt((model(x) * 0).sum())
            session.backward(loss)
            norms.append(float(session.clip_grad_norm_(1.0)))
            applied.append(session.step())
            if session.step_count == 4:
                break
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    session.close()
    return applied, finite, norms, [w for w in warnings if "non-finite" in w]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank_in_any_precision(precision):
    for rank, (applied, finite, norms, warnings) in enumerate(run_ranks(_nan_at, 2, precision)):
        assert applied == [True, True, False, True]
        assert finite
        assert math.isnan(norms[2])   # what torch's clip_grad_norm_ returns for NaN gradients (it said inf)
        # rank 0 says where it began: "the loss was non-finite gradients on some rank" named no rank
        assert warnings == ([] if rank else
                            ["step 3 skipped: non-finite gradients (the loss was not finite on rank 1; loss scale 1; "
                             "1 skipped so far)"]), warnings


def test_a_skipped_step_whose_losses_were_finite_says_the_overflow_came_in_backward():
    applied, _, _, warnings = run_ranks(_nan_at, 2, "fp32", "backward")[0]
    assert applied == [True, True, False, True]
    assert warnings == ["step 3 skipped: non-finite gradients (every rank's loss was finite: the overflow came in "
                        "backward; loss scale 1; 1 skipped so far)"], warnings


def _adamw(rank, world, sharding):
    import hetrain

    plan = Plan(global_batch_size=4, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=2) for r in range(world)])
    session = hetrain.Session(plan)
    net = Net()
    model, optimizer = session.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1))
    inner = getattr(optimizer, "optim", optimizer)
    settings = (type(inner).__name__, optimizer.param_groups[0]["weight_decay"])
    session.close()
    return settings


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_adamw_is_rebuilt_for_sharded_state_with_its_settings(sharding):
    assert run_ranks(_adamw, 2, sharding) == [("AdamW", 0.1)] * 2
