"""LR schedulers given to the session: stepped with each applied update, checkpointed, resumed exactly."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from hetrain.errors import HetrainError
from tests.distributed import run_ranks
from tests.log_lines import hetrain_warnings
from tests.runtime.test_refusals import make_data, make_net


def _one_cycle(optimizer):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=20)   # moves lr and momentum


def _warm_up(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))


def _run(directory, steps, *, schedule=_one_cycle, given="after", nan_at=None, sharding=None):
    """Train to `steps` (resuming what `directory` holds); returns (lr and momentum of each step run, parameters)."""
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = None
    if sharding is not None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(
            __import__("os").environ.get("WORLD_SIZE", "1"))
        plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                    ranks=[RankPlan(rank=r, share=8 // world) for r in range(world)])
    session = hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=3, async_checkpoints=False)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    if given == "before" and schedule is not None:
        session.add_scheduler(schedule(optimizer))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=True, seed=0)
    if given == "after" and schedule is not None:
        session.add_scheduler(schedule(optimizer))
    seen = []
    while session.step_count < steps:
        for x, y in loader:
            group = optimizer.param_groups[0]
            used = (group["lr"], group["momentum"])
            loss = F.cross_entropy(model(x), y)
            if session.step_count == nan_at:
                loss = loss * float("nan")
            session.backward(loss)
            seen.append(used)
            session.step()
            if session.step_count >= steps:
                break
    params = [p.detach().clone() for p in session.prepared.module.parameters()]
    session.close()
    return seen, params


@pytest.mark.parametrize("given", ["before", "after"])
def test_a_scheduler_given_to_the_session_resumes_the_same_schedule(tmp_path, given):
    """Stopped at step 7 and resumed (the scheduler given before or after the loader, which resumes),
    the run uses the same lr and momentum at every step and ends with the same parameters."""
    straight, end = _run(str(tmp_path / "a"), 12, given=given)
    first, _ = _run(str(tmp_path / "b"), 7, given=given)
    resumed, end_resumed = _run(str(tmp_path / "b"), 12, given=given)
    assert len(resumed) == 5
    assert first + resumed == straight
    assert len({lr for lr, _ in straight}) == 12   # the schedule moved every step
    assert all(torch.equal(a, b) for a, b in zip(end, end_resumed))


@pytest.mark.parametrize("given", ["before", "after"])
def test_a_scheduler_added_on_resuming_a_checkpoint_without_one_starts_its_schedule(tmp_path, given):
    """Given before the loader, the checkpoint's parameter groups replaced the ones OneCycleLR had built,
    and the first step failed with KeyError: 'initial_lr'. The schedule now starts from its beginning."""
    fresh, _ = _run(str(tmp_path / "fresh"), 5, given=given)
    _run(str(tmp_path / "b"), 6, schedule=None)
    resumed, _ = _run(str(tmp_path / "b"), 11, given=given)
    assert resumed == fresh, (resumed, fresh)   # lr and momentum of each step, as a fresh schedule's first 5


def test_another_kind_of_scheduler_on_resume_is_refused_naming_it(tmp_path):
    """A checkpoint saved with LambdaLR resumed under OneCycleLR failed at the first step with KeyError; StepLR
    resumed as ExponentialLR loaded silently and took StepLR's gamma."""
    _run(str(tmp_path / "a"), 6, schedule=_warm_up)
    with pytest.raises(HetrainError, match=r"state for a LambdaLR, and this run gives OneCycleLR: give the "
                                           r"scheduler the checkpoint was saved with"):
        _run(str(tmp_path / "a"), 9)
    _run(str(tmp_path / "b"), 6, schedule=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
    with pytest.raises(HetrainError, match=r"state for a StepLR, and this run gives ExponentialLR"):
        _run(str(tmp_path / "b"), 9, schedule=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9))
    _run(str(tmp_path / "c"), 6, schedule=lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=0.5, total_steps=20, cycle_momentum=False))
    with pytest.raises(HetrainError, match=r"state for a OneCycleLR built with other arguments \(it lacks use_beta1\)"):
        _run(str(tmp_path / "c"), 9)


def test_a_scheduler_once_loaded_from_a_checkpoint_with_plain_torch_resumes(tmp_path):
    """torch's load_state_dict keeps the class name saved beside a scheduler's state as an attribute, which its
    next state_dict returns: a resume of that run took it for a missing setting and refused."""
    step_lr = torch.optim.lr_scheduler.StepLR
    _run(str(tmp_path / "a"), 4, schedule=lambda o: step_lr(o, step_size=2, gamma=0.5))
    saved = torch.load(next((tmp_path / "a").glob("step-*/shared.pt")), weights_only=False)["schedulers"][0]

    def warm_started(optimizer):
        scheduler = step_lr(optimizer, step_size=2, gamma=0.5)
        scheduler.load_state_dict(saved)   # a warm start from another run's checkpoint, read with plain torch
        return scheduler

    straight_seen, straight = _run(str(tmp_path / "c"), 8, schedule=warm_started)
    _run(str(tmp_path / "b"), 6, schedule=warm_started)
    seen, resumed = _run(str(tmp_path / "b"), 8, schedule=warm_started)   # resumed: refused before
    assert seen == straight_seen[6:]   # the schedule goes on where it was
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))


def test_a_checkpoints_scheduler_state_not_given_again_is_said(tmp_path):
    _run(str(tmp_path), 6, schedule=_warm_up)
    with hetrain_warnings() as lines:   # (caplog saw them only where an earlier test had left the logger so)
        _run(str(tmp_path), 8, schedule=None)
    assert sum("holds the state of 1 LR scheduler(s) and this run gave 0" in line for line in lines) == 1, lines


def test_a_skipped_step_does_not_advance_the_schedule(tmp_path):
    seen, _ = _run(str(tmp_path), 6, schedule=_warm_up, nan_at=2)
    lrs = [lr for lr, _ in seen]
    # step 3's update is skipped (its loss is NaN); its lr is used again by the step that follows
    assert lrs == pytest.approx([0.02, 0.04, 0.06, 0.06, 0.08, 0.1])


def test_a_loops_own_scheduler_step_is_refused_before_the_update():
    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    scheduler = session.add_scheduler(_warm_up(optimizer))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
    x, y = next(iter(loader))
    session.backward(F.cross_entropy(model(x), y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(HetrainError, match="LambdaLR.step\\(\\) was called outside session.step\\(\\).*remove"):
        session.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))   # the refused step is not applied
    for x, y in loader:   # the loop without its own scheduler.step() goes on (refused at every step before)
        session.backward(F.cross_entropy(model(x), y))
        assert session.step()
        break
    assert session.step_count == 1
    session.close()


def test_a_scheduler_of_another_optimizer_is_refused():
    import hetrain

    session = hetrain.Session()
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    session.prepare(net, optimizer)
    other = torch.optim.SGD(make_net().parameters(), lr=0.1)
    with pytest.raises(HetrainError, match="build the scheduler on the returned optimizer"):
        session.add_scheduler(_warm_up(other))
    session.close()


def test_a_plateau_scheduler_is_saved_and_stepped_by_the_script(tmp_path):
    """ReduceLROnPlateau steps on the script's metric: the session leaves its steps alone and restores it."""
    import hetrain

    def run(steps):
        session = hetrain.Session(checkpoint_dir=str(tmp_path), checkpoint_interval=100, async_checkpoints=False)
        net = make_net()
        model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
        plateau = session.add_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0))
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            plateau.step(1.0)   # a metric that never improves: the lr falls after every step but the first
            if session.step_count >= steps:
                break
        lr = optimizer.param_groups[0]["lr"]
        session.close()
        return lr, plateau.num_bad_epochs

    lr, bad = run(3)
    assert lr == pytest.approx(0.1 * 0.1 ** 2) and bad == 0
    lr_resumed, _ = run(4)
    assert lr_resumed == pytest.approx(0.1 * 0.1 ** 3)


def _sharded(rank, world, directory, steps):
    return _run(directory, steps, sharding="zero1")


def test_a_zero1_schedule_resumes_on_another_number_of_ranks(tmp_path):
    """Saved by 2 ranks under ZeRO-1 (which re-creates the optimizer), resumed on 1: the same schedule."""
    straight = run_ranks(_sharded, 2, str(tmp_path / "a"), 10)[0][0]
    first = run_ranks(_sharded, 2, str(tmp_path / "b"), 6)[0][0]
    resumed = run_ranks(_sharded, 1, str(tmp_path / "b"), 10)[0][0]
    assert [lr for lr, _ in first + resumed] == pytest.approx([lr for lr, _ in straight])
    assert [m for _, m in first + resumed] == pytest.approx([m for _, m in straight])


@pytest.mark.parametrize("first, again, named", [
    (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=100), "T_max: checkpoint 10, this run 100"),
    (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=100, gamma=0.5), "step_size: checkpoint 2, this run 100"),
])
def test_a_scheduler_resumed_with_other_arguments_is_refused_naming_them(tmp_path, first, again, named):
    """Loading the state put the checkpoint's T_max back: a run resumed with T_max=100 to train longer went on
    along the T_max=10 curve, saying nothing."""
    _run(str(tmp_path), 4, schedule=first)
    with pytest.raises(HetrainError, match=rf"built with other arguments \({named}\): resuming would go on with the "
                                           r"checkpoint's; build it with those"):
        _run(str(tmp_path), 6, schedule=again)


def test_a_multistep_schedule_is_saved_and_resumed(tmp_path):
    """Its milestones are a collections.Counter, which a checkpoint refused at the first save ('a checkpoint holds
    tensors, ...'); resumed, the schedule goes on as one never stopped (found in review)."""
    multistep = lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 5], gamma=0.5)   # noqa: E731
    straight_seen, straight = _run(str(tmp_path / "a"), 8, schedule=multistep)
    _run(str(tmp_path / "b"), 4, schedule=multistep)
    seen, resumed = _run(str(tmp_path / "b"), 8, schedule=multistep)
    assert [lr for lr, _ in straight_seen] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025])
    assert seen == straight_seen[4:]   # resumed at step 4, where the first run closed
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))


def test_a_multistep_schedule_inside_a_sequential_one_is_saved_and_resumed(tmp_path):
    """A warm-up then MultiStepLR (SequentialLR): the Counter one level down was still refused (second review)."""
    def warm_then_steps(o):
        return torch.optim.lr_scheduler.SequentialLR(o, [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=2),
                                                         torch.optim.lr_scheduler.MultiStepLR(o, [2, 5], gamma=0.5)],
                                                     milestones=[2])
    straight_seen, straight = _run(str(tmp_path / "a"), 8, schedule=warm_then_steps)
    _run(str(tmp_path / "b"), 4, schedule=warm_then_steps)
    seen, resumed = _run(str(tmp_path / "b"), 8, schedule=warm_then_steps)
    assert seen == straight_seen[4:]
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))
