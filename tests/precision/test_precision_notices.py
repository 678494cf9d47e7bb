"""What a rank's precision settings tell the script, once: a forward that runs outside the plan's autocast,
loss-scale settings no rank uses, a skipped step's log naming the scale that overflowed."""

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.precision.test_mixed_precision import GLOBAL, make_data, make_model, make_optimizer


def _one_rank(precision: str) -> Plan:
    return Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=GLOBAL, precision=precision)])


def _warnings_of(run) -> list[str]:
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("hetrain").addHandler(handler)
    try:
        run()
    finally:
        logging.getLogger("hetrain").removeHandler(handler)
    return [r.getMessage() for r in records]


def _train(precision: str, *, use_autocast: bool, steps: int = 3, inf_at: int | None = None, **settings) -> None:
    import hetrain

    with hetrain.Session(_one_rank(precision), **settings) as session:
        net = make_model()
        model, _ = session.prepare(net, make_optimizer(net))
        for step, (x, y) in enumerate(session.loader(make_data(), global_batch_size=GLOBAL)):
            with session.autocast() if use_autocast else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss * float("inf") if step == inf_at else loss)
            session.step()
            if step + 1 == steps:
                break


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_forward_outside_the_plans_autocast_warns_once(precision):
    """A bf16/fp16 rank whose forward never entered `session.autocast()` ran in fp32, silently."""
    said = _warnings_of(lambda: _train(precision, use_autocast=False))
    outside = [m for m in said if "without autocast" in m]
    assert len(outside) == 1 and precision in outside[0] and "session.autocast()" in outside[0], said
    assert not [m for m in _warnings_of(lambda: _train(precision, use_autocast=True)) if "autocast" in m]


class _AutocastInside(torch.nn.Module):
    """A model that enters autocast inside its own forward (as some model code does)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.net(x).float()


def test_a_model_that_enters_autocast_inside_its_forward_is_not_warned():
    """The watch looked only around the model: a forward that autocasts inside itself was told it ran in fp32."""
    import hetrain

    def run():
        with hetrain.Session(_one_rank("bf16")) as session:
            net = _AutocastInside()
            model, _ = session.prepare(net, make_optimizer(net))
            for step, (x, y) in enumerate(session.loader(make_data(), global_batch_size=GLOBAL)):
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                if step == 1:
                    break

    assert not [m for m in _warnings_of(run) if "without autocast" in m]


def test_loss_scale_settings_on_a_plan_without_fp16_are_said_to_be_unused():
    said = _warnings_of(lambda: _train("bf16", use_autocast=True, loss_scale={"init_scale": 1024}))
    assert any("loss_scale=...) is unused" in m and "no rank of this plan is fp16" in m for m in said), said
    assert not [m for m in _warnings_of(lambda: _train("fp16", use_autocast=True, loss_scale={"init_scale": 1024}))
                if "unused" in m]


def test_a_skipped_step_names_the_scale_that_overflowed():
    """The log named the scale after its backoff (4 overflowed, the line said 2)."""
    said = _warnings_of(lambda: _train("fp16", use_autocast=True, inf_at=1, loss_scale={"init_scale": 4}))
    skipped = [m for m in said if "skipped" in m]
    assert len(skipped) == 1 and "step 2 skipped" in skipped[0] and "; loss scale 4;" in skipped[0], said


def test_a_starting_scale_below_its_floor_is_refused():
    import hetrain

    with pytest.raises(HetrainError, match="init_scale 0.25 is below min_scale 1"):
        hetrain.Session(_one_rank("fp16"), loss_scale={"init_scale": 0.25, "min_scale": 1})


def test_a_first_forward_that_raises_says_nothing_of_precision_and_the_next_one_is_watched():
    """The end-of-forward hook also runs when the forward raises: a first forward that failed (an
    out-of-memory, say) was told it ran in fp32, and the forward after it was never looked at."""
    from hetrain.runtime.precision import watch_precision

    model, calls = make_model(), []
    inner = model.forward

    def forward(x):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("bad batch")
        return inner(x)

    model.forward = forward
    watch_precision(model, torch.device("cpu"), "bf16", False)

    def run():
        with pytest.raises(ValueError):
            model(torch.randn(2, 8))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8))

    assert not [m for m in _warnings_of(run) if "without autocast" in m]
    said = _warnings_of(lambda: model(torch.randn(2, 8)))   # watched once, by the forward that ran
    assert not said
