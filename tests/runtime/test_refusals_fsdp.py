"""Habits of a ported loop between a step's micro-batches under FSDP2: each rank reads its own shards,
which may be empty, and the ranks refuse together."""

import pytest
import torch
import torch.nn.functional as F

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks
from tests.runtime.test_refusals import make_data


def _fsdp_habit(rank, world, habit):
    import hetrain

    plan = Plan(global_batch_size=8, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=6, micro_batch=2), RankPlan(rank=1, share=2)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 1), torch.nn.Tanh(), torch.nn.Linear(1, 1))   # rows of 1
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
    empty = all(p.to_local().numel() == 0 for p in net.parameters())
    try:
        for x, y in loader:
            if habit == "zero_grad":
                optimizer.zero_grad()
            elif habit == "zero_grad in place":
                optimizer.zero_grad(set_to_none=False)
            session.backward(F.mse_loss(model(x).squeeze(-1), y.float()) * 50)
            if habit == "torch clip":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
            session.step()
            if session.step_count == 2:
                break
    except HetrainError as e:
        session.close()
        return str(e), empty
    session.close()
    return None, empty


@pytest.mark.parametrize("habit,refused", [
    ("zero_grad", "earlier micro-batches are gone"),
    ("zero_grad in place", "earlier micro-batches are gone"),
    ("torch clip", "torch.nn.utils.clip_grad_norm_ or clip_grad_value_"),
])
def test_a_mid_step_habit_under_fsdp2_is_refused_on_every_rank_even_one_whose_shards_are_empty(habit, refused):
    """Under FSDP2 a zero_grad() between micro-batches went unchecked (the earlier micro-batches' gradients
    lost, silently), and a rank whose shards were empty could not see a clipping that its peer refused (the
    peer's error, this rank waiting in the next collective)."""
    results = run_ranks(_fsdp_habit, 2, habit)
    assert results[1][1], "rank 1 was meant to hold no element of the model"
    assert all(error is not None and refused in error for error, _ in results), results


def test_fsdp2_micro_batches_without_a_habit_are_not_refused():
    results = run_ranks(_fsdp_habit, 2, "none")
    assert all(error is None for error, _ in results), results


def _first_micro_batch_without_items(rank, world, sharding):
    import hetrain

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=4, micro_batch=2) for r in range(world)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0):
        first = session.state.micros == 1
        session.backward(F.mse_loss(model(x).squeeze(-1), y.float()), num_items=0 if first else x.shape[0])
        session.step()
        if session.step_count == 2:
            break
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    session.close()
    return params


def test_a_first_micro_batch_without_items_under_fsdp2_is_no_zero_grad():
    """Its all-zero shards were taken for a zero_grad() between micro-batches and the step refused on every
    rank (in-place changes of FSDP2 gradients move no version counter, so every read counted as a change)."""
    fsdp = run_ranks(_first_micro_batch_without_items, 2, "fsdp")
    ddp = run_ranks(_first_micro_batch_without_items, 2, "none")
    for a, b in zip(fsdp[0], ddp[0]):
        assert torch.allclose(a, b, atol=1e-6)


def _resume_fsdp(rank, world, directory, extra_head):
    import hetrain

    plan = Plan(global_batch_size=8, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=4) for r in range(world)])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if extra_head:
        net.head2 = torch.nn.Linear(3, 3)   # a head the loss does not use yet
    try:
        with hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=2) as session:
            model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0):
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                if session.step_count >= 2:
                    break
    except HetrainError as e:
        return str(e)
    return None


@pytest.mark.parametrize("first, then, named", [(True, False, "only the checkpoint has head2.bias, head2.weight"),
                                                (False, True, "only this model has head2.bias, head2.weight")])
def test_an_fsdp2_checkpoint_of_another_model_is_refused_naming_the_keys(tmp_path, first, then, named):
    """Its sharded load read the keys this model has: a head the checkpoint had and this model dropped was left
    without a word, and one this model added failed in DCP naming a 'template'."""
    assert run_ranks(_resume_fsdp, 2, str(tmp_path), first) == [None, None]
    errors = run_ranks(_resume_fsdp, 2, str(tmp_path), then)
    assert all(e is not None and "was saved from a different model (" + named in e and
               "start in an empty checkpoint directory" in e for e in errors), errors
