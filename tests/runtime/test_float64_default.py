"""A script that sets torch's default dtype to float64 (a numerics check, a scientific model): every
step's arithmetic in float64, and the update one float64 process makes, to 1e-12."""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks

GLOBAL, STEPS, LR = 8, 3, 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(GLOBAL * STEPS, 5, generator=g), torch.randn(GLOBAL * STEPS, 1, generator=g))


def _weights() -> torch.Tensor:
    """Each sample's item count (a token-mean loss's tokens): the global count is no power of two."""
    return torch.randint(1, 6, (GLOBAL * STEPS,), generator=torch.Generator().manual_seed(2)).double()


def _train(rank, world, token_mean=False):
    import hetrain

    torch.set_default_dtype(torch.float64)
    plan = Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=5, micro_batch=2), RankPlan(rank=1, share=3)])
    session = hetrain.Session(plan)
    net = _model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    x_all, y_all = _data().tensors
    for x, y, w in session.loader(TensorDataset(x_all, y_all, _weights()), global_batch_size=GLOBAL, shuffle=False):
        if token_mean:
            items = float(w.sum())
            session.backward((w * (model(x) - y).squeeze(1) ** 2).sum() / items, num_items=items)
        else:
            session.backward(F.mse_loss(model(x), y))
            session.clip_grad_norm_(0.5)
        session.step()
        if session.step_count == STEPS:
            break
    params = [p.detach().clone() for p in net.parameters()]
    session.close()
    return params


def test_a_float64_default_trains_as_one_float64_process():
    """step() failed in float64 ('inv_scale must be a float tensor'): the unscale kernel takes float32."""
    results = run_ranks(_train, 2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net, data = _model(), _data()
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = data[step * GLOBAL:(step + 1) * GLOBAL]
            F.mse_loss(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_default_dtype(default)
    for params in results:
        assert all(p.dtype == torch.float64 for p in params)
        assert max((a - b).abs().max().item() for a, b in zip(params, net.parameters())) < 1e-12


def test_a_float64_token_mean_loss_trains_as_one_float64_process():
    """The item-count correction was rounded to float32 (the fused unscale kernel's factor): 1e-9 off a
    float64 process's update where the true item count differs from the step's estimate."""
    results = run_ranks(_train, 2, True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net, (x_all, y_all), w_all = _model(), _data().tensors, _weights()
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step in range(STEPS):
            x, y, w = (t[step * GLOBAL:(step + 1) * GLOBAL] for t in (x_all, y_all, w_all))
            ((w * (net(x) - y).squeeze(1) ** 2).sum() / w.sum()).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_default_dtype(default)
    for params in results:
        assert max((a - b).abs().max().item() for a, b in zip(params, net.parameters())) < 1e-13


def test_the_loss_and_evaluation_a_float64_script_reads_keep_float64():
    """session.loss and session.evaluate() came back rounded to float32 (2e-8 off), though the step was exact."""
    import hetrain

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with hetrain.Session() as session:
            net = _model()
            model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
            for x, y in session.loader(_data(), global_batch_size=GLOBAL, shuffle=False):
                with torch.no_grad():
                    want = F.mse_loss(net(x), y).item()
                session.backward(F.mse_loss(model(x), y))
                session.step()
                break
            assert abs(session.loss - want) <= 1e-12 * abs(want), (session.loss, want)
            x_all, y_all = _data().tensors
            with torch.no_grad():
                want = F.mse_loss(net(x_all), y_all).item()
            got = session.evaluate(x_all, y_all, F.mse_loss)
            assert abs(got - want) <= 1e-12 * abs(want), (got, want)
    finally:
        torch.set_default_dtype(default)
