"""What a script does to its optimizer and schedulers beyond the plain loop: a group added mid-run, a chained
schedule, the optimizer given to prepare() changed where the session trains another, a schedule the session
was not given. Each either works as one process's or stops with one line naming the fix; none is silent."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.log_lines import hetrain_warnings
from tests.runtime.test_refusals import make_data, make_net


def _session(sharding="none", **options):
    import hetrain

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8)])
    return hetrain.Session(plan, **options)


def _steps(session, model, loader, n):
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        n -= 1
        if n == 0:
            return


@pytest.mark.parametrize("sharding", ["none", "zero1", "fsdp"])
def test_a_resume_without_a_group_added_mid_run_is_refused_naming_the_fix(tmp_path, sharding):
    """Under FSDP2 the added group's state was dropped silently (its Adam steps counted from 0), under ZeRO-1
    torch stopped with an IndexError, without sharding the message blamed another model."""
    for run in range(2):
        session = _session(sharding, checkpoint_dir=tmp_path, checkpoint_interval=2, async_checkpoints=False)
        net = make_net()
        for p in net[0].parameters():
            p.requires_grad_(False)
        model, optimizer = session.prepare(net, torch.optim.AdamW(net[2].parameters(), lr=1e-2))
        if run == 1:
            with pytest.raises(HetrainError, match="optimizer of 2 parameter groups and this script's has 1.*"
                                                   "add_param_group.*requires_grad=False"):
                session.loader(make_data(), global_batch_size=8, shuffle=False)
            session.close()
            return
        loader = session.loader(make_data(), global_batch_size=8, shuffle=False)
        _steps(session, model, loader, 1)
        for p in net[0].parameters():   # unfrozen at step 1, as a fine-tuning script does
            p.requires_grad_(True)
        optimizer.add_param_group({"params": [p for p in model.parameters()][:2], "lr": 1e-3})
        _steps(session, model, loader, 1)
        session.close()


def test_a_chained_schedule_stepped_by_the_loop_too_is_refused():
    """A ChainedScheduler counts no steps of its own: stepped by the loop and by the session, its schedule ran
    twice a step with no word."""
    session = _session()
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    chained = torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.5)])
    session.add_scheduler(chained)
    loader = iter(session.loader(make_data(), global_batch_size=8, shuffle=False))
    x, y = next(loader)
    session.backward(F.cross_entropy(model(x), y))
    assert session.step() and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    x, y = next(loader)
    session.backward(F.cross_entropy(model(x), y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        chained.step()
    with pytest.raises(HetrainError, match="ChainedScheduler.step\\(\\) was called outside session.step\\(\\)"):
        session.step()
    session.close()


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_a_change_to_the_optimizer_prepare_replaced_is_refused(sharding):
    """Under ZeRO-1 and FSDP2 the session trains an optimizer of its own: a schedule built after prepare() on the
    script's (or an lr set in it) moved nothing, silently."""
    session = _session(sharding)
    net = make_net()
    given = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = session.prepare(net, given)
    assert optimizer is not given
    loader = iter(session.loader(make_data(), global_batch_size=8, shuffle=False))
    x, y = next(loader)
    session.backward(F.cross_entropy(model(x), y))
    assert session.step()   # untouched: no word
    given.param_groups[0]["lr"] = 0.0
    x, y = next(loader)
    session.backward(F.cross_entropy(model(x), y))
    with pytest.raises(HetrainError, match="optimizer given to session.prepare\\(\\) changed after it \\(lr of "
                                           "parameter group 0: 0.1 -> 0.0.*the returned one"):
        session.step()
    session.close()


def test_a_schedule_the_session_was_not_given_is_said_at_the_first_checkpoint(tmp_path):
    """It is not saved: a resume restarted its warm-up with no word."""
    session = _session(checkpoint_dir=tmp_path, checkpoint_interval=1, async_checkpoints=False)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    with hetrain_warnings() as lines:
        for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            if session.step():
                scheduler.step()
            if session.step_count == 3:
                break
    session.close()
    assert sum("none was given to session.add_scheduler()" in line for line in lines) == 1


def test_a_schedule_the_script_steps_each_epoch_and_saves_with_add_state_resumes_with_no_warning(tmp_path):
    """A per-epoch schedule saved through session.add_state() was still told to go to add_scheduler(), and a
    MultiStepLR's milestones (a Counter) made the first checkpoint fail."""
    def run(steps):
        session = _session(checkpoint_dir=tmp_path, checkpoint_interval=1, async_checkpoints=False)
        net = make_net()
        model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        scheduler = session.add_state("lr_schedule", torch.optim.lr_scheduler.MultiStepLR(optimizer, [1, 2], 0.5))
        with hetrain_warnings() as lines:
            loader = session.loader(make_data(), global_batch_size=8, shuffle=False)   # 4 steps an epoch
            while session.step_count < steps:
                for x, y in loader:
                    session.backward(F.cross_entropy(model(x), y))
                    session.step()
                    if session.step_count == steps:
                        break
                else:
                    scheduler.step()
        session.close()
        return scheduler, optimizer, lines

    scheduler, optimizer, lines = run(6)   # epoch 0, its scheduler.step(), 2 steps of epoch 1
    assert (scheduler.last_epoch, optimizer.param_groups[0]["lr"]) == (1, 0.05)
    assert not any("add_scheduler" in line for line in lines), lines
    resumed, optimizer, lines = run(6)   # resumes at step 6: nothing left to train
    assert (resumed.last_epoch, optimizer.param_groups[0]["lr"]) == (1, 0.05)
    assert not any("add_scheduler" in line for line in lines), lines


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_a_tensor_learning_rate_the_rebuilt_optimizer_shares_is_not_taken_for_a_change(sharding):
    """The rebuilt optimizer holds the script's lr tensor, which the session's scheduler moves in place."""
    session = _session(sharding)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.Adam(net.parameters(), lr=torch.tensor(0.01)))
    session.add_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5))
    _steps(session, model, session.loader(make_data(), global_batch_size=8, shuffle=False), 3)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.01 / 8)
    session.close()


@pytest.mark.parametrize("sharding", ["none", "zero1", "fsdp"])
@pytest.mark.parametrize("added_at", [0, 1])
def test_a_module_added_after_prepare_and_given_to_the_optimizer_is_refused(sharding, added_at):
    """Its gradients were neither all-reduced nor divided by the global batch's items (each rank's copy moved
    apart: 0.166 on two ranks without sharding), and FSDP2 never sharded it; silent, exit 0. Layers frozen at
    prepare() and unfrozen later are the model's own and go on (the first test above)."""
    session = _session(sharding)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False)
    with pytest.raises(HetrainError, match=r"2 parameter\(s\) that were not in the model given to "
                                           r"session.prepare\(\) \(extra.weight, extra.bias\).*build the whole model"):
        for step, (x, y) in enumerate(loader):
            if step == added_at:
                net.extra = torch.nn.Linear(3, 3)
                optimizer.add_param_group({"params": list(net.extra.parameters())})
            session.backward(F.cross_entropy(getattr(net, "extra", torch.nn.Identity())(model(x)), y))
            session.step()
    session.close()


def _unfreeze_the_head_of_a_pipeline(rank, world):
    import hetrain
    from tests.pipeline.common import make_data, make_model, pipeline_plan

    session = hetrain.Session(pipeline_plan([[0, 4], [4, 8]], "gpipe", microbatches=2, global_batch=12))
    net = make_model(6)
    for p in net[7].parameters():          # the head frozen for the first step (fine-tuning)
        p.requires_grad_(False)
    model, optimizer = session.prepare(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=12, shuffle=True, seed=0):
        if session.step_count == 1:         # then unfrozen and given to the optimizer, on every stage alike
            for p in net[7].parameters():
                p.requires_grad_(True)
            optimizer.add_param_group({"params": list(net[7].parameters()), "lr": 0.01})
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        if session.step_count == 3:
            break
    session.close()
    return session.step_count


def test_a_group_of_another_stages_parameters_added_mid_run_is_the_models_own():
    """Stage 0 refused the head (stage 1's) as 'not in the model given to session.prepare()'."""
    from tests.distributed import run_ranks

    assert run_ranks(_unfreeze_the_head_of_a_pipeline, 2) == [3, 3]


def test_a_checkpoints_counter_conversion_leaves_every_other_container_as_it_was():
    """Passing every add_state entry through it rebuilt containers: a nested OrderedDict came back a dict, and
    a namedtuple failed the first checkpoint with a TypeError instead of the checkpoint's one-line refusal."""
    import collections

    from hetrain.runtime.schedulers import loadable, savable

    point = collections.namedtuple("Point", "x y")
    ordered = collections.OrderedDict(b=1)
    state = {"ordered": ordered, "point": point(1, 2), "steps": [1, {"seen": collections.Counter(a=2)}]}
    saved = savable(state)
    assert saved["ordered"] is ordered and saved["point"] is state["point"]
    assert saved["steps"][1]["seen"] == {"hetrain_counter": {"a": 2}}
    back = loadable(saved)
    assert type(back["ordered"]) is collections.OrderedDict and back["point"] == point(1, 2)
    assert back["steps"][1]["seen"] == collections.Counter(a=2) and type(back["steps"][1]["seen"]) is collections.Counter
    assert savable(point(collections.Counter(a=1), 2)) == point({"hetrain_counter": {"a": 1}}, 2)
