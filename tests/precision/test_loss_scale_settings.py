"""The job's loss scale is set as a GradScaler's is: Session(loss_scale={...}), checked in one line."""

import pytest
import torch
import torch.nn.functional as F

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan


def test_the_scripts_init_scale_and_growth_interval_are_the_jobs():
    import hetrain

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8, precision="fp16")])
    session = hetrain.Session(plan, loss_scale={"init_scale": 1024, "growth_interval": 2})
    net = torch.nn.Linear(4, 2)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert session.scaler.scale == 1024
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    for x, y in session.loader(data, global_batch_size=8, shuffle=False):
        with session.autocast():
            loss = F.cross_entropy(model(x), y)
        session.backward(loss)
        session.step()
        if session.step_count == 3:
            break
    assert session.scaler.scale == 2048 and session.scaler.good_steps == 3   # grown once, after 2 good steps
    session.close()


@pytest.mark.parametrize("settings,named", [
    ({"growth_factor": 0.5}, "growth_factor"),
    ({"backoff_factor": 1.5}, "backoff_factor"),
    ({"init_scale": 0}, "init_scale"),
    ({"growth_intervall": 10}, "growth_intervall"),
])
def test_a_bad_loss_scale_setting_is_one_line_naming_it(settings, named):
    from hetrain.runtime.precision import loss_scale_settings

    with pytest.raises(HetrainError, match=rf"loss_scale=.*{named}") as e:
        loss_scale_settings(settings)
    assert "\n" not in str(e.value)
