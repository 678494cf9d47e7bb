"""Gradients written after a step and before the next one's first session.backward() (a notebook's sanity
cell, a GAN's generator loss through its discriminator, a plain loss.backward() on a batch also given to
session.backward()) are not part of the next step: `session.step()` starts each step from zero, as the
docs say, so a script without its own zero_grad() makes one process's update."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks
from tests.log_lines import hetrain_warnings

GLOBAL, STEPS, LR = 8, 3, 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(GLOBAL * STEPS, 5, generator=g), torch.randn(GLOBAL * STEPS, 1, generator=g))


def _train(rank, world, sharding):
    import hetrain

    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=5, micro_batch=2), RankPlan(rank=1, share=3)])
    session = hetrain.Session(plan)
    net = _model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    for x, y in session.loader(_data(), global_batch_size=GLOBAL, shuffle=False):
        if rank == 1 and not session.state.between_micro_batches():   # a step's first backward on this rank
            for p in model.parameters():
                p.grad = torch.full_like(p, 7.0)   # written outside the step (another model's backward)
        session.backward(F.mse_loss(model(x), y))
        session.step()
        if session.step_count == STEPS:
            break
    state = session.model_state_dict()
    session.close()
    return state


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_gradients_written_between_steps_are_left_out_of_the_next(sharding):
    state = run_ranks(_train, 2, sharding)[0]
    net, data = _model(), _data()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = data[step * GLOBAL:(step + 1) * GLOBAL]
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    for name, want in net.state_dict().items():
        assert torch.allclose(state[name], want, atol=1e-6), name


def test_a_sanity_backward_before_the_loop_is_left_out_with_a_warning():
    import hetrain

    net, data = _model(), _data()
    ref = _model()
    with hetrain.Session() as session:
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
        F.mse_loss(model(data.tensors[0]), data.tensors[1]).backward()   # a notebook cell's check
        with hetrain_warnings() as lines:
            for x, y in session.loader(data, global_batch_size=GLOBAL, shuffle=False):
                session.backward(F.mse_loss(model(x), y))
                session.step()
                break
    assert sum("held gradients at a step's first session.backward()" in line for line in lines) == 1
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    x, y = data[:GLOBAL]
    F.mse_loss(ref(x), y).backward()
    opt.step()
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(net.parameters(), ref.parameters()))


def test_a_trainable_layer_the_optimizer_takes_later_is_not_called_a_backward_outside_the_session():
    """Staged fine-tuning: the head trains, but joins the optimizer (add_param_group) at step 2. step() zeroes the
    optimizer's gradients, so the head's stayed, and every step warned of a 'loss.backward() outside the session'
    the script never ran. Its update was right, and is."""
    import hetrain

    net, data, ref = _model(), _data(), _model()
    with hetrain.Session() as session:
        model, optimizer = session.prepare(net, torch.optim.SGD(net[0].parameters(), lr=LR))
        with hetrain_warnings() as lines:
            for x, y in session.loader(data, global_batch_size=GLOBAL, shuffle=False):
                if session.step_count == 2:
                    optimizer.add_param_group({"params": net[2].parameters(), "lr": LR / 2})
                session.backward(F.mse_loss(model(x), y))
                session.step()
    assert not [line for line in lines if "held gradients" in line], lines
    opt = torch.optim.SGD(ref[0].parameters(), lr=LR)
    for step in range(STEPS):
        if step == 2:
            opt.add_param_group({"params": ref[2].parameters(), "lr": LR / 2})
        x, y = data[step * GLOBAL:(step + 1) * GLOBAL]
        ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(net.parameters(), ref.parameters()))
