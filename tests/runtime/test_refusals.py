"""Inputs the Session refuses with one line naming the fix, and a run that stops instead of going wrong."""

import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks, session_error
from tests.log_lines import hetrain_warnings


def make_data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def make_net(hidden: int = 8, depth: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, hidden), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 3))


def _train(directory, steps, net, optimizer_fn, nan_from=None):
    import hetrain

    session = hetrain.Session(checkpoint_dir=directory, checkpoint_interval=2, async_checkpoints=False)
    model, _ = session.prepare(net, optimizer_fn(net))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=True, seed=0)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        if nan_from is not None and session.step_count >= nan_from:
            loss = loss * float("nan")
        session.backward(loss)
        session.step()
        if session.step_count >= steps:
            break
    session.close()


def adam(net):
    return torch.optim.Adam(net.parameters(), lr=1e-3)


@pytest.mark.parametrize("other", [
    lambda: (make_net(hidden=16), adam),                                   # wider
    lambda: (make_net(depth=2), adam),                                     # deeper
    lambda: (make_net(), lambda n: torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9)),   # another optimizer
    lambda: (make_net(), lambda n: torch.optim.AdamW(n.parameters(), lr=1e-3, weight_decay=0.1)),
])
def test_resuming_with_another_model_or_optimizer_is_refused_with_the_fix(tmp_path, other):
    _train(str(tmp_path), 2, make_net(), adam)
    net, opt = other()
    with pytest.raises(HetrainError, match=r"(different model|optimizer).*(start in an empty checkpoint directory)"):
        _train(str(tmp_path), 4, net, opt)


def test_a_changed_learning_rate_resumes_with_the_checkpoints_and_says_so(tmp_path):
    """The checkpoint's lr goes on, as optimizer.load_state_dict() does (a schedule's position is in it); a
    script that changed it was given the old one and no word."""
    from tests.log_lines import hetrain_warnings

    _train(str(tmp_path), 2, make_net(), adam)
    used = []

    def smaller(net):
        optimizer = torch.optim.Adam(net.parameters(), lr=5e-4)
        used.append(optimizer)
        return optimizer

    with hetrain_warnings() as lines:
        _train(str(tmp_path), 4, make_net(), smaller)
    assert used[0].param_groups[0]["lr"] == 1e-3
    said = [line for line in lines if "other optimizer settings" in line]
    assert len(said) == 1 and "group 0 lr: checkpoint 0.001, script 0.0005" in said[0], lines
    assert "set them after session.loader()" in said[0]
    with hetrain_warnings() as lines:   # the same settings again: nothing to say
        _train(str(tmp_path), 6, make_net(), adam)
    assert not [line for line in lines if "other optimizer settings" in line], lines


def test_a_weight_decay_scheduled_by_hand_resumes_with_the_checkpoints_and_a_fused_flag_with_the_scripts(tmp_path):
    """A weight decay the loop sets before each step (a cosine schedule of it) differs from the one the script
    builds with, and the resume was refused, every restart alike; so was fused=True turned on between runs, which
    changes how the step runs, not what it computes."""
    _train(str(tmp_path), 2, make_net(), lambda n: torch.optim.Adam(n.parameters(), lr=1e-3, weight_decay=0.05))
    used = []

    def other(net):
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        used.append(optimizer)
        return optimizer

    with hetrain_warnings() as lines:
        _train(str(tmp_path), 4, make_net(), other)
    group = used[0].param_groups[0]
    assert group["weight_decay"] == 0.05 and group["fused"] is True
    said = [line for line in lines if "other optimizer settings" in line]
    assert len(said) == 1 and "group 0 weight_decay: checkpoint 0.05, script 0.01" in said[0], lines
    assert "fused" not in said[0]


def _fsdp_run(directory, steps, amsgrad):
    import hetrain

    plan = Plan(global_batch_size=8, sharding="fsdp", balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8)])
    session = hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=2, async_checkpoints=False)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3, amsgrad=amsgrad))
    try:
        for x, y in session.loader(make_data(), global_batch_size=8, shuffle=True, seed=0):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count >= steps:
                break
    finally:
        session.close()


def test_a_setting_that_decides_the_optimizers_state_is_refused_where_a_sharded_checkpoint_is_read():
    """FSDP2 reads its checkpoint into the state the script's optimizer keeps: amsgrad turned off at a resume
    failed at the first step with torch's KeyError 'max_exp_avg_sq'."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        _fsdp_run(directory, 2, amsgrad=True)
        with pytest.raises(HetrainError, match=r"keeps other state than the checkpoint's \(amsgrad: checkpoint True, "
                                               r"script False\).*start in an empty checkpoint directory"):
            _fsdp_run(directory, 4, amsgrad=False)


def test_optimizer_state_loaded_before_prepare_keeps_the_scripts_param_groups():
    """A ported script holds a param group (`head = optimizer.param_groups[1]`) and sets its lr later: with state
    loaded before prepare(), prepare() replaced the groups, and the head trained on at the old lr."""
    import hetrain

    net = make_net()
    earlier = torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[2].parameters()}], lr=0.1, momentum=0.9)
    F.cross_entropy(net(make_data().tensors[0]), make_data().tensors[1]).backward()
    earlier.step()
    optimizer = torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[2].parameters()}], lr=0.1, momentum=0.9)
    optimizer.load_state_dict(earlier.state_dict())
    head = optimizer.param_groups[1]
    with hetrain.Session(balance=False) as session:
        model, _ = session.prepare(net, optimizer)
        head["lr"] = 0.0
        before = net[2].weight.detach().clone()
        for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            break
    assert torch.equal(net[2].weight, before)


def test_replaced_settings_compare_where_a_schedule_started_and_leave_a_cycled_momentum_alone():
    from hetrain.runtime.train_state import replaced_settings

    scheduled = {"lr": 0.0004, "initial_lr": 0.001, "momentum": 0.9}
    assert replaced_settings([scheduled], [{"lr": 0.001, "initial_lr": 0.001, "momentum": 0.9}]) == []
    assert replaced_settings([scheduled], [{"lr": 0.002, "initial_lr": 0.002, "momentum": 0.5}]) == [
        "group 0 lr: checkpoint 0.001, script 0.002", "group 0 momentum: checkpoint 0.9, script 0.5"]
    # a schedule given after session.loader() sets its own start (OneCycleLR: max_lr / div_factor)
    assert replaced_settings([scheduled], [{"lr": 0.1, "momentum": 0.9}]) == []
    # ReduceLROnPlateau keeps no start: the lr it lowered is not the script's changed one (found in review)
    assert replaced_settings([{"lr": 0.0125}], [{"lr": 0.1}], scheduled=True) == []
    assert replaced_settings([{"lr": 0.0125}], [{"lr": 0.1}]) == ["group 0 lr: checkpoint 0.0125, script 0.1"]
    # a script whose schedule, built before session.loader(), keeps a start the checkpoint's did not: a KeyError
    assert replaced_settings([{"lr": 0.0125}], [{"lr": 0.1, "initial_lr": 0.1}], scheduled=True) == []
    cycled = {"lr": 0.01, "initial_lr": 0.004, "momentum": 0.85, "base_momentum": 0.85, "max_momentum": 0.95}
    assert replaced_settings([cycled], [{"lr": 0.004, "momentum": 0.95}]) == []
    assert replaced_settings([{"lr": 0.1, "betas": [0.9, 0.999]}], [{"lr": 0.1, "betas": [0.9, 0.95]}]) == [
        "group 0 betas: checkpoint [0.9, 0.999], script [0.9, 0.95]"]


def test_consecutive_non_finite_steps_stop_the_run_and_keep_good_checkpoints(tmp_path):
    import hetrain

    with pytest.raises(HetrainError, match=r"3 steps in a row had non-finite gradients"):
        with hetrain.Session(checkpoint_dir=str(tmp_path), checkpoint_interval=1, async_checkpoints=False,
                             max_skipped_steps=3) as session:
            net = make_net()
            model, _ = session.prepare(net, adam(net))
            for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False):
                loss = F.cross_entropy(model(x), y) * (float("nan") if session.step_count >= 1 else 1.0)
                session.backward(loss)
                session.step()
    saved = torch.load(tmp_path / "step-000001" / "shared.pt", weights_only=False)
    assert all(bool(torch.isfinite(v).all()) for v in saved["model"].values())


@pytest.mark.parametrize("name,value,match", [
    ("HETRAIN_CHECKPOINT_INTERVAL", "abc", "HETRAIN_CHECKPOINT_INTERVAL='abc' is not an integer"),
    ("HETRAIN_COLLECTIVE_TIMEOUT", "nan", "HETRAIN_COLLECTIVE_TIMEOUT='nan' must be a finite number"),
])
def test_bad_environment_values_are_named(monkeypatch, tmp_path, name, value, match):
    import hetrain

    monkeypatch.setenv(name, value)
    monkeypatch.setenv("HETRAIN_CHECKPOINT_DIR", str(tmp_path))
    with pytest.raises(HetrainError, match=match):
        hetrain.Session()


def _min_share(rank, world):
    import hetrain

    plan = Plan(global_batch_size=128, balance=BalancePlan(min_share=100),
                ranks=[RankPlan(rank=r, share=64) for r in range(world)])
    session = hetrain.Session(plan)
    net = make_net()
    session.prepare(net, adam(net))
    try:
        session.loader(make_data(256), global_batch_size=128)
    except HetrainError as e:
        return str(e)
    return "accepted"


def test_a_min_share_no_split_can_meet_is_refused():
    for message in run_ranks(_min_share, 2):
        assert "min_share 100 on 2 ranks needs a global batch of at least 200" in message


def test_a_step_after_a_plain_loss_backward_names_session_backward():
    """loss.backward() leaves each rank's gradient unweighted by its share: step() refuses it."""
    import hetrain

    with hetrain.Session() as session:
        net = make_net()
        model, _ = session.prepare(net, adam(net))
        for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False):
            F.cross_entropy(model(x), y).backward()
            with pytest.raises(HetrainError, match=r"no session\.backward\(loss\): call it in place of loss\.backward"):
                session.step()
            with pytest.raises(HetrainError, match=r"no session\.backward\(loss\)"):
                session.clip_grad_norm_(1.0)
            session.backward(F.cross_entropy(model(x), y))
            assert session.step() and session.loss is not None
            break


def _session_and_loader():
    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return session, model, optimizer, session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)


def test_two_backwards_of_one_batch_are_refused_also_after_the_gradients_are_finished():
    """Two losses of one batch, each through session.backward: the first finished the step's gradients,
    and the second added to them weighted again ((g1 + g2) / 2 at the first step, g1 + g2 / 2 after)."""
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    session, model, _, loader = _session_and_loader()
    x, y = next(iter(loader))
    session.backward(F.cross_entropy(model(x), y))
    with pytest.raises(HetrainError, match="called twice for one batch.*session.backward\\(loss_a \\+ loss_b\\)"):
        session.backward(F.cross_entropy(model(x), y) * 0.5)
    assert session.step()
    session.close()
    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8, micro_batch=4)])
    session = hetrain.Session(plan)   # under micro-batches: one backward a piece
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    pieces = iter(session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0))
    x, y = next(pieces)
    session.backward(F.cross_entropy(model(x), y))
    with pytest.raises(HetrainError, match="called twice for one batch"):
        session.backward(F.cross_entropy(model(x), y))
    x, y = next(pieces)
    session.backward(F.cross_entropy(model(x), y))
    assert session.step()
    session.close()


def test_accumulating_over_batches_before_one_step_is_refused_at_the_next_batch():
    """A ported loop's own accumulation (backward on two batches, then one step) would mix two steps'
    gradients and divide them by one step's items: the next batch is refused, naming the fix."""
    session, model, _, loader = _session_and_loader()
    batches = iter(loader)
    x, y = next(batches)
    session.backward(F.cross_entropy(model(x), y))
    with pytest.raises(HetrainError, match="no session.step\\(\\) followed.*global_batch_size"):
        next(batches)
    session.close()


def test_the_prepared_optimizer_refuses_a_step_outside_session_step():
    """optimizer.step() of the user's own applies gradients not yet divided by the global batch's items
    (or a second update after session.step()); it is refused, and session.step() still steps."""
    session, model, optimizer, loader = _session_and_loader()
    x, y = next(iter(loader))
    session.backward(F.cross_entropy(model(x), y))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(HetrainError, match="optimizer.step\\(\\) was called outside session.step\\(\\)"):
        optimizer.step()
    with pytest.raises(HetrainError, match="GradScaler's scaler.step\\(optimizer\\).*delete the GradScaler"):
        torch.amp.GradScaler("cpu", enabled=False).step(optimizer)   # a ported loop's leftover
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert session.step() and not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    session.close()


def test_a_batch_drawn_and_dropped_is_a_warning_once():
    session, model, _, loader = _session_and_loader()
    next(iter(loader))                         # a look at the data: that step of data is skipped
    with hetrain_warnings() as lines:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            break
    assert sum("no session.step() followed" in line for line in lines) == 1, lines
    assert session.step_count == 1 and loader.step_in_epoch == 2
    session.close()


def _plan_session(sharding="none", micro_batch=None, precision="fp32"):
    import hetrain

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8, micro_batch=micro_batch, precision=precision)])
    return hetrain.Session(plan)


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_an_lr_scheduler_built_before_prepare_is_refused_where_sharding_recreates_the_optimizer(sharding):
    """The scheduler would keep driving the optimizer the session replaced: a warm-up's lr of 0 forever."""
    session = _plan_session(sharding)
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / 10)   # a warm-up from 0
    with pytest.raises(HetrainError, match="LR scheduler was built on this optimizer before session.prepare"):
        session.prepare(net, optimizer)
    session.close()


def test_zero_grad_between_micro_batches_is_refused_and_harmless_elsewhere():
    """A ported loop's optimizer.zero_grad() at the top: with micro-batches it wiped the earlier ones'
    gradients (a different update, silently); between steps it does nothing and is let be."""
    for micro_batch, refused in ((None, False), (4, True)):
        session = _plan_session(micro_batch=micro_batch)
        net = make_net()
        model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        pickle.dumps(net)   # nothing of hetrain's among the model's attributes: it still pickles whole
        loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
        try:
            for x, y in loader:
                optimizer.zero_grad()
                model.zero_grad()
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                if session.step_count == 2:
                    break
            assert not refused
        except HetrainError as e:
            assert refused and "between a step's micro-batches" in str(e), e
        session.close()


def test_the_model_still_pickles_after_training_steps():
    """The timer's hook on the script's own model (DDP's wrapped module) travels as one that does nothing:
    torch.save(model.module) after training works, and the copy times nothing."""
    import copy

    session = _plan_session()
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if session.step_count == 2:
            break
    copied = pickle.loads(pickle.dumps(net))
    assert torch.equal(copied(torch.ones(1, 6)), net(torch.ones(1, 6)))
    copy.deepcopy(net)(torch.ones(1, 6))
    session.close()


def test_gradients_zeroed_in_place_between_micro_batches_are_refused():
    """zero_grad(set_to_none=False) on each micro-batch changed the step's update silently (loss 1.1648
    against 1.1635): refused like a zero_grad() that sets them to None."""
    session = _plan_session(micro_batch=4)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
    with pytest.raises(HetrainError, match="earlier micro-batches are gone.*zeroed.*remove it"):
        for x, y in loader:
            optimizer.zero_grad(set_to_none=False)
            session.backward(F.cross_entropy(model(x), y))
            session.step()
    session.close()


@pytest.mark.parametrize("habit,refused", [
    ("torch clip", "clip_grad_norm_ or clip_grad_value_ (of the model, or of a parameter group) in a loop body"),
    ("torch clip, one layer", "in a loop body that runs once per micro-batch"),   # a group's own max_norm
    ("torch clip by value", "in a loop body that runs once per micro-batch"),
    ("scheduler each call", "the learning rate changed between the micro-batches of one step"),
    ("session clip, scheduler on True", None),
])
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_loop_body_habit_that_runs_once_per_micro_batch_is_refused(habit, refused, sharding):
    """With a plan's micro-batches the loop body runs per micro-batch: torch's clipping there clipped part of
    the step's gradient (0.145 off one process; 0.509 under FSDP2, where no check ran; a parameter group's
    own clipping or clip_grad_value_ 4.0e-2 and 2.5e-2 off on 2 ranks) and a scheduler stepped after every
    session.step() ran twice as fast (0.22 off), all silently."""
    session = _plan_session(sharding=sharding, micro_batch=4)
    net = make_net()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
    try:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y) * 50)   # large enough for a clip to clip
            if habit == "torch clip":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
            elif habit == "torch clip, one layer":
                torch.nn.utils.clip_grad_norm_(net[0].parameters(), 0.01)
            elif habit == "torch clip by value":
                torch.nn.utils.clip_grad_value_(net.parameters(), 0.001)
            else:
                session.clip_grad_norm_(0.01)
            applied = session.step()
            if habit == "scheduler each call" or applied:
                scheduler.step()
            if session.step_count == 3:
                break
        assert refused is None and scheduler.last_epoch == 3
    except HetrainError as e:
        assert refused is not None and refused in str(e), e
    session.close()


def _mask(g):
    g[:2] = 0


def _center_rows(g):   # a projection: once after every micro-batch is once
    g.sub_(g.mean(dim=1, keepdim=True))


def _noise(g):
    g.add_(1e-3 * torch.randn_like(g))


@pytest.mark.parametrize("edit", [_mask, _center_rows, _noise])
@pytest.mark.parametrize("only_one", [True, False])
def test_the_scripts_own_edit_of_a_gradient_between_micro_batches_is_not_taken_for_a_clipping(edit, only_one):
    """Fine-tuning one tensor and zeroing some of its rows' gradients was refused as a clipping (one tensor's
    2-norm alone cannot tell the two apart, its 1-norm with it can); a projection of one tensor's gradient,
    or noise on the only trained one, was refused as clip_grad_value_ (one changed tensor's largest value
    went down and was still the model's largest)."""
    torch.manual_seed(0)
    session = _plan_session(micro_batch=4)
    net = make_net()
    edited = next(net.parameters())
    if only_one:
        for p in list(net.parameters())[1:]:
            p.requires_grad_(False)
    model, _ = session.prepare(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y) * 50)
        with torch.no_grad():
            edit(edited.grad)
        session.step()
        if session.step_count == 4:
            break
    assert session.step_count == 4
    session.close()


def test_a_new_iterator_each_micro_batch_names_the_iterator_not_a_missing_step():
    session = _plan_session(micro_batch=4)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
    with pytest.raises(HetrainError, match=r"micro-batches left: a new iter\(loader\).*keep one iterator"):
        for _ in range(3):
            x, y = next(iter(loader))   # a lazy habit: each iteration a fresh iterator
            session.backward(F.cross_entropy(model(x), y))
            session.step()
    session.close()


def _clipped_run(sharding: str, precision: str, clip: str, token_mean: bool) -> list[torch.Tensor]:
    """Three steps of one rank, clipped by torch's function after backward or by the session's."""
    session = _plan_session(sharding=sharding, precision=precision)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    applied = 0
    for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0):
        with session.autocast():
            out = model(x)
        if token_mean:   # items vary by step: the session's first estimate of the count is off later
            kept = y != 0
            loss, items = F.cross_entropy(out[kept], y[kept]), int(kept.sum())
        else:
            loss, items = F.cross_entropy(out, y), None
        session.backward(loss, num_items=items)
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)   # small enough to clip every step
        else:
            session.clip_grad_norm_(0.05)
        applied += session.step()
        if session.step_count == 4:
            break
    assert applied >= 2
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    session.close()
    return params


@pytest.mark.parametrize("precision,token_mean", [("fp32", True), ("fp16", False), ("fp16", True)])
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_torch_clipping_after_backward_clips_the_final_gradient(precision, token_mean, sharding):
    """Between the step's last backward and step() the gradients were still multiplied by the fp16 loss
    scale (torch's clipping clipped the update to almost nothing, and was refused) or weighted by an
    estimated token count (it clipped to about 0.68 of max_norm, silently: 6.3e-3 off one process after
    6 steps of GPT-2). The last backward finishes them now: torch's clipping clips what the session's does."""
    torch_clip = _clipped_run(sharding, precision, "torch", token_mean)
    session_clip = _clipped_run(sharding, precision, "session", token_mean)
    for a, b in zip(torch_clip, session_clip):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_a_mask_on_loss_scaled_gradients_is_the_scripts_own():
    session = _plan_session(precision="fp16")
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = next(iter(session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)))
    with session.autocast():
        session.backward(F.cross_entropy(model(x), y))
    net[0].weight.grad[:2] = 0
    assert session.step()
    session.close()


def test_ranks_given_different_plans_are_refused_on_every_rank():
    """Each node splitting the global batch its own way took 80 of 640 samples twice an epoch, silently."""
    plans = [Plan(global_batch_size=8, balance=BalancePlan(enabled=False),   # two nodes, two plan files
                  ranks=[RankPlan(rank=r, share=n) for r, n in enumerate(shares)]) for shares in ([4, 4], [2, 6])]
    errors = run_ranks(session_error, 2, None, plans)
    assert all(e is not None and "different plans (rank 0: plan" in e and "same --plan file" in e for e in errors), errors


def test_nodes_started_with_different_nnodes_are_refused_on_every_rank():
    """The rendezvous runs with the first node's --nnodes: a node started with 3 and one with 2 trained on 2."""
    errors = run_ranks(session_error, 2, {"HETRAIN_NNODES": ["3", "2"]})   # what each node's launcher was given
    assert all(e is not None and "different --nnodes" in e and "rank 0: 3; rank 1: 2" in e for e in errors), errors


def _through_module(session, model, x, y):
    session.backward(F.cross_entropy(model.module(x), y))   # skips DDP: no gradient is all-reduced


def _inside_no_sync(session, model, x, y):
    with model.no_sync():   # a DDP script's accumulation, left in
        session.backward(F.cross_entropy(model(x), y))


def _train_with(rank, world, backward):
    """Train on the digits-sized data with `backward(session, model, x, y)` in the loop: None, or the refusal."""
    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False)

    def train():
        for x, y in loader:
            backward(session, model, x, y)
            session.step()

    return _refusal(session, train)


def _refusal(session, work):
    """None when `work()` runs through, else the HetrainError's text; the session closed either way."""
    try:
        work()
        return None
    except HetrainError as e:
        return str(e)
    finally:
        session.close()


def test_a_training_forward_through_model_module_is_refused():
    """Each rank stepped on its own gradients (clip norms 2.28 and 2.06 where the step's is 0.85), exit 0."""
    errors = run_ranks(_train_with, 2, _through_module)
    assert all(e is not None and "not all-reduced" in e and "model.module" in e for e in errors), errors


def test_a_step_run_inside_no_sync_is_refused_naming_no_sync():
    errors = run_ranks(_train_with, 2, _inside_no_sync)
    assert all(e is not None and "ran inside model.no_sync()" in e and "model.module" not in e for e in errors), errors


def _wrapped_in_ddp():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(make_net())


def _sync_batchnorm():
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)))


def _prepare(rank, world, build):
    """session.prepare() of the model `build()` makes: None, or the refusal."""
    import hetrain

    session = hetrain.Session()
    net = build()
    return _refusal(session, lambda: session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1)))


def test_a_model_the_script_already_wrapped_in_ddp_is_refused():
    errors = run_ranks(_prepare, 2, _wrapped_in_ddp)
    assert all(e is not None and "already wrapped in DistributedDataParallel" in e and "model.module" in e
               for e in errors), errors


def _left_in_eval(rank, world):
    import logging

    import hetrain

    session = hetrain.Session()
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hetrain").addHandler(handler)
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        model.eval()   # an evaluation after each step, and no model.train()
        if session.step_count == 3:
            break
    session.close()
    return [r.getMessage() for r in records if "eval mode" in r.getMessage()]


def test_training_a_model_left_in_eval_mode_warns_once():
    warnings = run_ranks(_left_in_eval, 2)
    assert all(len(w) == 1 and "call model.train() after evaluating" in w[0] for w in warnings), warnings


def test_a_model_converted_to_sync_batchnorm_on_cpu_ranks_names_the_fix():
    errors = run_ranks(_prepare, 2, _sync_batchnorm)
    assert all(e is not None and "leave out nn.SyncBatchNorm.convert_sync_batchnorm" in e for e in errors), errors
    # one rank too (it reached torch's ValueError at the first forward)
    session = _plan_session()
    with pytest.raises(HetrainError, match="leave out nn.SyncBatchNorm.convert_sync_batchnorm"):
        session.prepare(_sync_batchnorm(), None)
    session.close()



@pytest.mark.parametrize("kind", ["two", "lbfgs"])
def test_two_optimizers_or_one_that_needs_a_closure_are_refused_at_prepare(kind):
    """A GAN's two optimizers crashed on a list's missing method; LBFGS at the first step, on its closure."""
    import hetrain

    session = hetrain.Session()
    net = make_net()
    optimizer = ([torch.optim.SGD(net.parameters(), lr=0.1)] * 2 if kind == "two"
                 else torch.optim.LBFGS(net.parameters()))
    match = "takes one torch.optim.Optimizer, got list" if kind == "two" else "LBFGS.step\\(\\) needs a closure"
    with pytest.raises(HetrainError, match=match):
        session.prepare(net, optimizer)
    session.close()


def _pipeline_left_in_eval(rank, world):
    import logging

    import hetrain
    from tests.pipeline.common import count_labels, make_data, make_model, pipeline_plan

    session = hetrain.Session(pipeline_plan([[0, 4], [4, 8]], "1f1b", 2, 8))
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hetrain").addHandler(handler)
    for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False):
        session.forward_backward(x, y, F.cross_entropy, num_items=count_labels)
        session.step()
        net.eval()   # the script's model: its blocks are the stages'
        if session.step_count == 3:
            break
    session.close()
    return [r.getMessage() for r in records if "eval mode" in r.getMessage()]


def test_a_pipeline_stage_left_in_eval_mode_warns_once():
    """Dropout stayed off under a pipeline plan without the warning the data-parallel plans give."""
    warnings = run_ranks(_pipeline_left_in_eval, 2)
    assert all(len(w) == 1 and w[0].startswith("session.forward_backward() on a model in eval mode") for w in warnings), \
        warnings


def test_a_resume_with_another_global_batch_is_refused_naming_the_way_on_with_the_weights(tmp_path):
    import hetrain

    def run(global_batch, steps):
        with hetrain.Session(checkpoint_dir=str(tmp_path), checkpoint_interval=2, async_checkpoints=False) as session:
            net = make_net()
            model, _ = session.prepare(net, adam(net))
            for x, y in session.loader(make_data(), global_batch_size=global_batch, shuffle=True, seed=0):
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                if session.step_count >= steps:
                    break

    run(8, 2)
    with pytest.raises(HetrainError, match=r"data order \(global batch 8, seed 0\) differs from this loader's \(16, 0\); "
                                           r"resume with the same global_batch_size and seed, or start in an empty "
                                           r"checkpoint directory, loading this checkpoint's model weights first"):
        run(16, 4)


def test_the_clipping_checks_count_of_non_zeros_is_exact_for_a_bf16_gradient():
    """Counted in bf16 it rounds to 256 apart above 32k values: a mask of a few looked like no mask."""
    from hetrain.runtime.step_guard import norms_of

    g = torch.ones(40_000, dtype=torch.bfloat16)
    g[:16] = 0
    assert norms_of([g])[0][3].item() == 39_984


@pytest.mark.parametrize("call", ["global_mean", "evaluate"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_figure_over_ranks_taken_between_a_steps_micro_batches_is_refused_naming_where_to_take_it(call, gated,
                                                                                                      sharding):
    """A loop body that averaged its loss over ranks on every pass (`log(loss, sync_dist=True)` ported to
    session.global_mean) ran that collective once per micro-batch: where ranks run different numbers of them
    the calls paired up wrong and the job ended in gloo's SIGABRT. Taken where step() returns True it runs;
    under FSDP2, where every rank runs the job's count, global_mean pairs on every pass and runs there too."""
    session = _plan_session(sharding=sharding, micro_batch=2)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, shuffle=False, seed=0)
    figures = []

    def figure(x, y):
        if call == "global_mean":
            return session.global_mean(F.cross_entropy(model(x), y).detach())
        net.eval()
        value = session.evaluate(x, y, F.cross_entropy)
        net.train()
        return value

    try:
        for x, y in loader:
            if not gated:
                figures.append(figure(x, y))
            session.backward(F.cross_entropy(model(x), y))
            if session.step() and gated:
                figures.append(figure(x, y))
        every_pass = not gated and sharding == "fsdp" and call == "global_mean"
        assert (gated or every_pass) and len(figures) == (16 if every_pass else 4), len(figures)
        assert all(math.isfinite(f) for f in figures)
    except HetrainError as e:
        assert not gated and figures == [], e   # refused in the step's first micro-batch, before any backward: a rank
        #                                          with fewer pieces would make fewer calls (gloo's abort, in review)
        assert str(e).startswith(f"session.{call}() ran between the micro-batches of a step"), e
        assert "where session.step() returns True" in str(e)
    session.close()


def test_a_second_loader_or_model_is_refused_naming_what_to_do_instead():
    """An Accelerate habit (`prepare(val_dataloader)`) and a frozen teacher given to prepare() again got a
    refusal that named no way forward, or the GAN's."""
    session = _plan_session()
    net = make_net()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(HetrainError, match=r"already called; a session trains one model.*a frozen teacher, an EMA, "
                                           r"a reference model\) needs none: run it as it is"):
        session.prepare(make_net())
    session.loader(make_data(), global_batch_size=8)
    with pytest.raises(HetrainError, match=r"already called; a session reads one dataset, the training set: evaluate "
                                           r"on a plain DataLoader .*session.evaluate\(\) or session.global_mean\(\)"):
        session.loader(make_data(16), global_batch_size=8)
    session.close()
