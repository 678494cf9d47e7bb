"""session.model_state_dict(): the whole trained model on rank 0 under any plan, loadable into a fresh copy
of the model passed to prepare(). Under a pipeline the documented full_state_dict route saved half a model
(rank 0 had its stage's 26 of 53 tensors) with no error."""

import pytest
import torch
import torch.nn.functional as F

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks
from tests.pipeline.common import LR, make_data, make_model, pipeline_plan, reference

GLOBAL, STEPS = 8, 2


def _train_and_export(rank, world, plan):
    import hetrain

    session = hetrain.Session(plan)
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    for x, y in session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0):
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        if session.step_count == STEPS:
            break
    state = session.model_state_dict()
    session.close()
    return state


def _data_parallel(sharding: str) -> Plan:
    return Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=5), RankPlan(rank=1, share=3)])


@pytest.mark.parametrize("plan,world", [
    (_data_parallel("none"), 2),
    (_data_parallel("fsdp"), 2),
    (pipeline_plan([[0, 3], [3, 8]], "1f1b", 2, GLOBAL), 2),
    (pipeline_plan([[0, 4], [4, 8]], "1f1b", 2, GLOBAL, replica_shares=[5, 3]), 4),
    (pipeline_plan([[0, 2], [2, 4], [4, 6], [6, 8]], "interleaved-1f1b", 2, GLOBAL).model_copy(
        update={"pipeline": pipeline_plan([[0, 2], [2, 4], [4, 6], [6, 8]], "interleaved-1f1b", 2,
                                          GLOBAL).pipeline.model_copy(update={"chunks": 2}),
                "ranks": [RankPlan(rank=r, share=GLOBAL, stage=r) for r in range(2)]}), 2),
    (pipeline_plan([[0, 3], [3, 8]], "1f1b", 2, GLOBAL).model_copy(update={"sharding": "fsdp"}), 2),
    (pipeline_plan([[0, 3], [3, 8]], "1f1b", 2, GLOBAL, replica_shares=[5, 3]).model_copy(
        update={"sharding": "fsdp"}), 4),
], ids=["ddp", "fsdp", "1f1b", "hybrid", "interleaved", "fsdp-stages", "hybrid-fsdp-stages"])
def test_the_whole_trained_model_reaches_rank_0(plan, world):
    results = run_ranks(_train_and_export, world, plan, timeout=180)
    assert all(r is None for r in results[1:])
    want = reference(STEPS, GLOBAL)[-1]
    got = results[0]
    assert set(got) == set(want), sorted(set(want) ^ set(got))
    fresh = make_model(seed=7)
    fresh.load_state_dict(got)                     # the keys of the model passed to prepare()
    for k, v in want.items():
        assert got[k].device.type == "cpu" and torch.allclose(got[k], v, atol=1e-5), k
