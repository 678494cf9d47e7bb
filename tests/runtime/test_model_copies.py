"""A copy of the model prepare() returned (copy.deepcopy, torch.optim.swa_utils.AveragedModel of it), as a
script makes for an EMA, SWA or a frozen reference model, as it can of a DDP model under torchrun: the copy
computes what the model does, and the session trains as it would without it. A copy failed with 'cannot
pickle WeakMethod object' (the session's hooks on the wrapper) and then '_thread.lock' (its comm hook's)."""

import copy

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from hetrain.planning.plan import BalancePlan, CommPlan, Plan, RankPlan
from tests.distributed import run_ranks

PLANS = {
    "ddp": {},
    "micro-batches fp16": {"ranks": [RankPlan(rank=0, share=5, micro_batch=2, precision="fp16"),
                                      RankPlan(rank=1, share=3)]},
    "int8 hierarchical": {"comm": CommPlan(compression="int8", hierarchical=True, islands=[[0], [1]])},
    "zero1": {"sharding": "zero1"},
}


def _train(rank, world, kind, copies):
    import hetrain

    fields = {"ranks": [RankPlan(rank=0, share=5), RankPlan(rank=1, share=3)], **PLANS[kind]}
    session = hetrain.Session(Plan(global_batch_size=8, balance=BalancePlan(enabled=False), **fields))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    ema = None
    if copies:
        frozen = copy.deepcopy(model)   # a reference model: the weights at the start, frozen
        with torch.no_grad():
            at_start = net(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        optimizer.register_step_post_hook(lambda *_: ema.update_parameters(model))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    for x, y in session.loader(data, global_batch_size=8, shuffle=False):
        with session.autocast():
            loss = torch.nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        session.step()
    probe = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    out = {"weights": {k: v.clone() for k, v in net.state_dict().items()}}
    if copies:
        with torch.no_grad():
            out["frozen_equals_start"] = torch.equal(frozen(probe), at_start) and not torch.equal(net(probe), at_start)
            out["ema"] = {k: v.clone() for k, v in ema.module.state_dict().items()}
            out["ema_forward"] = ema(probe)
    session.close()
    return out


@pytest.mark.parametrize("kind", list(PLANS))
def test_a_copy_of_the_prepared_model_computes_as_it_and_leaves_the_training_unchanged(kind):
    plain = run_ranks(_train, 2, kind, False)
    copied = run_ranks(_train, 2, kind, True)
    for rank in (0, 1):
        for name, value in plain[0]["weights"].items():
            assert torch.equal(copied[rank]["weights"][name], value), (rank, name)
        assert copied[rank]["frozen_equals_start"]
    assert all(torch.equal(copied[0]["ema"][k], v) for k, v in copied[1]["ema"].items())   # one EMA on every rank
    assert not torch.equal(copied[0]["ema"]["module.0.weight"], plain[0]["weights"]["0.weight"])  # it averaged
    assert torch.isfinite(copied[0]["ema_forward"]).all()
