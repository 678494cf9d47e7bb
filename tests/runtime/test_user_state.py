"""The script's own state (`session.add_state`) goes into every checkpoint and comes back on resume: an EMA
of the weights updated with each applied update (an AveragedModel, or a dict of tensors a hook updates in
place), and a dict of the script's values, end where an uninterrupted run's do."""

import pytest
import torch
import torch.nn.functional as F

from hetrain.errors import HetrainError
from tests.distributed import run_ranks, train_steps


def _train(rank, world, ckpt_dir, steps, stop_after, add_late):
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    torch.manual_seed(0)
    session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=3)
    train, _ = digits_datasets()
    net = digits_mlp(hidden=32)
    model, opt = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    values = {"updates": 0, "losses": []}
    # an EMA of the script's own, a dict of tensors its hook holds and updates in place
    own_ema = {k: v.detach().clone() for k, v in net.state_dict().items()}
    held, weights = list(own_ema.values()), list(net.state_dict().values())
    # the EMAs and the count move with each applied update, before that step's checkpoint
    opt.register_step_post_hook(lambda *_: (ema.update_parameters(net), values.update(updates=values["updates"] + 1),
                                            torch._foreach_lerp_(held, weights, 0.1)))
    if not add_late:
        session.add_state("ema", ema)
        session.add_state("values", values)
        session.add_state("own_ema", own_ema)
    loader = session.loader(train, global_batch_size=64, seed=2)
    if add_late:   # given after loader(), which resumed: loaded when given
        session.add_state("ema", ema)
        session.add_state("values", values)
        session.add_state("own_ema", own_ema)
    resumed_at = session.step_count

    def body(batch):
        x, y = batch
        session.backward(F.cross_entropy(model(x), y))
        values["losses"].append(round(session.global_mean(F.cross_entropy(model(x), y).detach()), 6))

    if not train_steps(session, loader, steps, stop_after, body):
        return {}                                   # a crash: no final save
    session.close()
    return {"ema": {k: v.clone() for k, v in ema.state_dict().items()}, "values": values, "resumed_at": resumed_at,
            "own_ema": {k: v.clone() for k, v in own_ema.items()}}


@pytest.mark.parametrize("add_late", [False, True])
def test_an_ema_and_the_scripts_values_resume_where_an_uninterrupted_run_has_them(tmp_path, add_late):
    straight = run_ranks(_train, 2, str(tmp_path / "x"), 10, None, add_late)
    run_ranks(_train, 2, str(tmp_path / "y"), 10, 7, add_late)      # stops after step 7 (saved at 6)
    resumed = run_ranks(_train, 2, str(tmp_path / "y"), 10, None, add_late)
    assert resumed[0]["resumed_at"] == 6
    assert resumed[0]["values"] == straight[0]["values"]
    assert resumed[0]["values"]["updates"] == 10 and len(resumed[0]["values"]["losses"]) == 10
    for k, v in straight[0]["ema"].items():
        assert torch.equal(v, resumed[0]["ema"][k]), k
    for k, v in straight[0]["own_ema"].items():   # restored into the tensors the hook holds, not beside them
        assert torch.equal(v, resumed[0]["own_ema"][k]), k


def test_state_without_state_dict_is_refused_naming_what_it_takes():
    import hetrain

    with hetrain.Session() as session:
        with pytest.raises(HetrainError, match="state_dict"):
            session.add_state("best", 0.5)
        session.add_state("values", {})
        with pytest.raises(HetrainError, match="already"):
            session.add_state("values", {})


def _rank_own_state(rank, world, ckpt_dir):
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=1)
    net = digits_mlp(hidden=8)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    session.add_state("mine", {"part": torch.full((3,), float(rank))})   # each rank's own, as FSDP2's shards are
    try:
        for x, y in session.loader(digits_datasets()[0], global_batch_size=32):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
    except HetrainError as e:
        return str(e)
    return None


def test_state_that_differs_between_ranks_is_refused_at_the_first_checkpoint(tmp_path):
    """A checkpoint holds rank 0's copy: rank 1's EMA of its own shards resumed as rank 0's (5.4e-1 off)."""
    errors = run_ranks(_rank_own_state, 2, str(tmp_path))
    assert all(e is not None and "add_state('mine') differs between ranks (rank 0 and rank 1)" in e for e in errors)


def _same_state_other_threads(rank, world, ckpt_dir):
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    torch.set_num_threads(1 + rank)   # the ranks add a float sum in other orders
    session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=1)
    net = digits_mlp(hidden=8)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    session.add_state("ema", {"w": torch.randn(5_000_000, generator=torch.Generator().manual_seed(0))})
    for x, y in session.loader(digits_datasets()[0], global_batch_size=32):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if session.step_count == 2:
            break
    session.close()
    return session.step_count


def test_state_the_same_on_every_rank_is_never_refused(tmp_path):
    """A float sum of identical values differed between 1 and 2 threads, and refused identical state."""
    assert run_ranks(_same_state_other_threads, 2, str(tmp_path)) == [2, 2]


def _placeholders(directory, stop_after=None):
    """A dict state built on placeholders: the model's own weights (`net.state_dict()`, views of them), one
    tensor under two keys and three list slots, an integer tensor later holding a float, an expanded zero."""
    import math

    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8)])
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    with hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=1, async_checkpoints=False) as session:
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        state = session.add_state("state", {"best": math.inf, "weights": net.state_dict(),
                                            **dict.fromkeys(["first", "last"], torch.zeros(())),
                                            "history": [torch.zeros(())] * 3, "accuracy": torch.tensor(0),
                                            "expanded": torch.zeros(()).expand(4)})
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            session.backward(F.mse_loss(model(x), y))
            k = session.step_count + 1   # changed before the step: its checkpoint holds them
            if k == 3:
                state["weights"] = {n: v.clone() for n, v in net.state_dict().items()}
            state["first" if k == 1 else "last"] = torch.tensor(float(k))
            state["history"][k % 3] = torch.tensor(float(k))
            state["accuracy"], state["expanded"] = torch.tensor(k + 0.5), torch.arange(4.0) * k
            session.step()
            if k == stop_after:
                raise RuntimeError("stop")
    return [p.detach().clone() for p in net.parameters()], state


def test_a_dict_state_restores_beside_tensors_it_shares_with_the_model_or_with_itself(tmp_path):
    """Restored in place, a placeholder holding the model's weights took the step-2 best weights over the
    resumed model, keys sharing one tensor all took the last value, an int placeholder truncated 5.5 to 5, and
    an expanded one failed with torch's 'more than one element of the written-to tensor'."""
    expected, whole = _placeholders(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="stop"):
        _placeholders(tmp_path / "resumed", stop_after=6)
    weights, resumed = _placeholders(tmp_path / "resumed")
    assert all(torch.equal(a, b) for a, b in zip(weights, expected))
    assert float(resumed["first"]) == 1.0 and float(resumed["last"]) == 8.0
    assert [float(t) for t in resumed["history"]] == [6.0, 7.0, 8.0]
    assert resumed["accuracy"].dtype == torch.float32 and float(resumed["accuracy"]) == 8.5
    for key in ("weights", "expanded"):
        assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(resumed[key]),
                                                     torch.utils._pytree.tree_leaves(whole[key])))


def _flat_views(rank, world, directory, stop_after):
    """A dict state of two views into one flat buffer (a fused EMA's parts) and a count, under FSDP2 (its
    parameters are DTensors) or DDP."""
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    sharding = "fsdp" if world == 2 else "none"
    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=8 // world) for r in range(world)])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    flat = torch.zeros(6)
    with hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=2, async_checkpoints=False) as session:
        model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        optimizer.register_step_post_hook(lambda *_: flat.add_(1.0))
        state = session.add_state("ema", {"a": flat[:3], "b": flat[3:]})
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            session.backward(F.mse_loss(model(x), y))
            session.step()
            if session.step_count == stop_after:
                raise RuntimeError("stop")
        linked = state["a"].data_ptr() == flat.data_ptr()
    return flat.tolist(), linked


@pytest.mark.parametrize("world", [1, 2])
def test_views_of_one_buffer_restore_into_it_and_fsdp2_resumes(tmp_path, world):
    """Restored beside the buffer, the views were stale copies and the buffer started again from zero; under
    FSDP2 any dict state failed to resume ('access the data pointer on an invalid python storage'), and the
    optimizer's step hook (the buffer's update) also ran at every checkpoint: torch's distributed checkpoint
    steps an SGD without state at learning rate 0 to create its state."""
    with pytest.raises(AssertionError, match="RuntimeError: stop"):   # after step 5, resumed from step 4
        run_ranks(_flat_views, world, str(tmp_path), 5)
    for flat, linked in run_ranks(_flat_views, world, str(tmp_path), None):
        assert flat == [8.0] * 6 and linked   # 8 steps, every one counted in the buffer the views look into


def test_a_state_no_checkpoint_could_hold_is_refused_when_given():
    """A NumPy scalar in a state given to add_state() was refused only at the first checkpoint, a checkpoint
    interval into the run (found auditing); it is refused when given, naming where it is."""
    import numpy as np

    import hetrain
    from hetrain.errors import HetrainError

    with hetrain.Session() as session:
        with pytest.raises(HetrainError, match=r"session.add_state\('best'\)\['value'\] is a numpy.float64"):
            session.add_state("best", {"value": np.float64(0.5)})
        session.add_state("best_ok", {"value": 0.5})


def test_sharded_tensors_given_to_add_state_are_refused_in_the_sessions_words():
    """The check at add_state() gave the checkpoint library's fix ("pass sharded state in `sharded`"), an
    argument add_state has not (found in review)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import hetrain
    from hetrain.errors import HetrainError

    with hetrain.Session() as session:
        shard = distribute_tensor(torch.randn(4), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(HetrainError, match=r"session.add_state\('ema'\) holds sharded tensors \(DTensor, "
                                               r"FSDP2's shards\).*keep full tensors there"):
            session.add_state("ema", {"w": shard})
