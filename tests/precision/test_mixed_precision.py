"""Ranks in bf16, fp16 and fp32 make one update: the single-process one under the same precisions."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.data import GlobalBatchOrder, rank_slice
from hetrain.runtime.precision import JobLossScaler
from tests.precision.plain import PlainLossScale, plain_autocast
from tests.distributed import run_ranks

PRECISIONS = ["bf16", "fp16", "fp32"]
SHARES = [5, 4, 3]
GLOBAL = sum(SHARES)
EPOCHS = 2
SEED = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 3))


def make_data(n: int = 72) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def full_loss(model) -> float:
    x, y = make_data().tensors
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def make_plan(precisions) -> Plan:
    return Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, precision=p) for r, (s, p) in enumerate(zip(SHARES, precisions))])


def _train(rank, world, precisions, inf_at):
    import hetrain

    session = hetrain.Session(make_plan(precisions))
    net = make_model()
    model, optimizer = session.prepare(net, make_optimizer(net))
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=SEED)
    params, applied, scales = [], [], []
    step = 0
    for _ in range(EPOCHS):
        for x, y in loader:
            handle = None
            if step == inf_at and rank == 1:
                handle = net[2].weight.register_hook(lambda g: g * float("inf"))
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
            if handle is not None:
                handle.remove()
            applied.append(session.step())
            scales.append(session.scaler.scale)
            params.append([p.detach().clone() for p in net.parameters()])
            step += 1
    return {"params": params, "applied": applied, "scales": scales, "loss": full_loss(net)}


def reference(precisions):
    """One process computes each rank's slice in that rank's precision, with the job's loss scale."""
    model = make_model()
    params = list(model.parameters())
    optimizer = make_optimizer(model)
    scaler = PlainLossScale(enabled="fp16" in precisions)
    data, order = make_data(), GlobalBatchOrder(72, GLOBAL, shuffle=True, seed=SEED)
    history, applied = [], []
    for epoch in range(EPOCHS):
        for step in range(order.steps_per_epoch):
            batch = order.global_batch(epoch, step)
            total = [torch.zeros_like(p) for p in params]
            for r, prec in enumerate(precisions):
                x, y = data[rank_slice(batch, SHARES, r)]
                with plain_autocast(prec):
                    loss = F.cross_entropy(model(x), y)
                grads = torch.autograd.grad((scaler.scale * loss * (SHARES[r] * 3 / GLOBAL)), params)
                total = [t + g / 3 for t, g in zip(total, grads)]
            for p, t in zip(params, total):
                p.grad = t / scaler.scale
            finite = all(bool(torch.isfinite(p.grad).all()) for p in params)
            if finite:
                optimizer.step()
            scaler.update(finite)
            optimizer.zero_grad(set_to_none=True)
            history.append([p.detach().clone() for p in params])
            applied.append(finite)
    return history, applied, full_loss(model)


def test_bf16_fp16_fp32_ranks_match_reference_and_fp32_loss():
    results = run_ranks(_train, 3, PRECISIONS, -1)
    want, want_applied, mixed_loss = reference(PRECISIONS)
    _, _, fp32_loss = reference(["fp32"] * 3)
    worst = 0.0
    for rank in range(3):
        assert results[rank]["applied"] == want_applied
        for got_step, want_step in zip(results[rank]["params"], want, strict=True):
            for got, ref in zip(got_step, want_step):
                worst = max(worst, (got - ref).abs().max().item())
    assert worst < 1e-5, worst
    final = results[0]["loss"]
    assert abs(final - mixed_loss) < 1e-5
    assert fp32_loss < full_loss(make_model()) * 0.8  # it trained
    assert abs(final - fp32_loss) / fp32_loss < 0.02, (final, fp32_loss)


def test_inf_on_one_rank_skips_that_step_on_every_rank():
    k = 2
    results = run_ranks(_train, 3, PRECISIONS, k)
    for rank in range(3):
        r = results[rank]
        assert r["applied"][k] is False and r["applied"][k - 1] is True
        assert r["scales"][k] == r["scales"][k - 1] / 2
        for before, after in zip(r["params"][k - 1], r["params"][k]):
            assert torch.equal(before, after)
        assert all(math.isfinite(p.abs().max().item()) for p in r["params"][-1])
    for step in range(len(results[0]["params"])):
        for other in (1, 2):
            for a, b in zip(results[0]["params"][step], results[other]["params"][step]):
                assert torch.equal(a, b), (step, other)


def test_half_precision_master_weights_are_refused():
    import hetrain

    with hetrain.Session() as session:
        with pytest.raises(HetrainError, match="fp32"):
            session.prepare(make_model().to(torch.bfloat16))


def test_scaler_state_round_trips_and_grows_identically():
    a = JobLossScaler(enabled=True, growth_interval=2)
    for finite in (True, True, False, True):
        a.update(finite)
    b = JobLossScaler(enabled=True, growth_interval=2)
    b.load_state_dict(a.state_dict())
    assert (b.scale, b.good_steps) == (2.0**16, 1)
    a.update(True), b.update(True)
    assert a.scale == b.scale == 2.0**17


def test_a_grad_scalers_state_from_a_run_before_hetrain_loads_into_the_job_scale():
    """A ported run continuing its fp16 training: session.scaler.load_state_dict(scaler.state_dict()) of torch's
    GradScaler raised a bare KeyError('good_steps')."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(2):
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    job = JobLossScaler(enabled=True, growth_interval=3)
    job.load_state_dict(scaler.state_dict())
    assert (job.scale, job.good_steps) == (1024.0, 2)
    job.update(True)   # the third good step grows the scale, as it would have grown the GradScaler's
    assert job.scale == 2048.0
    job.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())   # {}: nothing to take
    assert (job.scale, job.good_steps) == (2048.0, 3)


def test_loss_scale_has_a_floor():
    """1,091 overflows in a row once took the scale to 0.0 and a ZeroDivisionError."""
    scaler = JobLossScaler(enabled=True, min_scale=1.0)
    for _ in range(1091):
        scaler.update(False)
    assert scaler.scale == 1.0
    scaler.load_state_dict({"enabled": True, "scale": 0.0, "good_steps": 0})
    assert scaler.scale == 1.0


def test_a_loss_a_grad_scaler_already_scaled_is_refused_naming_it():
    """Left over from a ported script, it was scaled twice: 16 steps skipped, then one 65536x too large."""
    import hetrain

    with hetrain.Session(balance=False) as session:
        net = make_model()
        model, _ = session.prepare(net, make_optimizer(net))
        scaler = torch.amp.GradScaler("cpu")
        for x, y in session.loader(make_data(), global_batch_size=GLOBAL):
            loss = F.cross_entropy(model(x), y)
            for scaled in (scaler.scale(loss), scaler.scale(loss) / 2, scaler.scale(loss.unsqueeze(0)).mean()):
                with pytest.raises(HetrainError, match="GradScaler"):
                    session.backward(scaled)
            with pytest.raises(HetrainError, match="GradScaler"):
                session.backward(scaler.scale(loss) + 1e-4 * net[0].weight.square().sum())
            scaled_inside = F.cross_entropy(model(x) * torch.tensor(1024.0), y)   # the model's own multiply
            session.backward(scaled_inside + loss * torch.tensor(3.0))   # weighted by tensors: the script's own
            session.step()
            break


def _token_mean_first_steps(rank, world):
    import hetrain

    session = hetrain.Session(make_plan(PRECISIONS))
    net = make_model()
    model, _ = session.prepare(net, make_optimizer(net))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 256, 8, generator=g)
    y = torch.randint(0, 3, (24, 256), generator=g)
    y[:, 200:] = -100                                   # padding: 200 tokens of 256 count
    applied, scales = [], []
    for xb, yb in session.loader(TensorDataset(x, y), global_batch_size=GLOBAL, shuffle=False):
        with session.autocast():
            loss = F.cross_entropy(model(xb).reshape(-1, 3).float(), yb.reshape(-1), ignore_index=-100)
        session.backward(loss, num_items=(yb != -100).sum())
        applied.append(session.step())
        scales.append(session.scaler.scale)
    session.close()
    return applied, scales


def test_a_token_mean_loss_does_not_overflow_the_first_fp16_step():
    """Before any step had ended the estimate counted one item per sample: the first step's loss weighed 200
    times too much, overflowed on the fp16 rank and was skipped on every rank."""
    for applied, scales in run_ranks(_token_mean_first_steps, 3):
        assert applied == [True, True], applied
        assert scales == [2.0**16, 2.0**16], scales


def test_the_scripts_own_fp16_autocast_without_a_loss_scale_warns_once():
    """No rank of the plan is fp16, so the job keeps no loss scale: fp16 gradients underflowed silently."""
    import copy
    import logging

    import hetrain

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("hetrain").addHandler(handler)
    try:
        with hetrain.Session(balance=False) as session:
            net = make_model()
            model, _ = session.prepare(net, make_optimizer(net))
            copied = copy.deepcopy(net)   # the model still copies; a copy's watch says nothing
            for step, (x, y) in enumerate(session.loader(make_data(), global_batch_size=GLOBAL)):
                with torch.autocast("cpu", dtype=torch.float16):
                    with torch.no_grad():
                        copied(x), model.module(x)   # evaluations: no gradient to underflow
                    loss = F.cross_entropy(model(x), y)
                session.backward(loss)
                session.step()
                if step == 2:
                    break
    finally:
        logging.getLogger("hetrain").removeHandler(handler)
    said = [r.getMessage() for r in records if "fp16 autocast" in r.getMessage()]
    assert len(said) == 1 and "session.autocast()" in said[0]
