"""A pipeline stage sharded over its replicas (FSDP2) gathers each block's weights m + 1 times a step, as the
planner prices it (a forward reshards them, a backward keeps them: each warm-up forward and each backward that
follows a forward gathers). The planner charged 2m, a gather in every forward and every backward, up to twice
the gathers the runtime makes."""

import pytest
import torch
from torch.nn import functional as F

from hetrain.planning import cost_model as cm
from hetrain.planning.plan import PipelinePlan
from hetrain.planning.partition import interleaved_stages
from hetrain.planning.planner import plan_job
from hetrain.hardware import cluster_from_devices

from tests.distributed import run_ranks
from tests.pipeline.common import make_data, make_model, pipeline_plan
from tests.pipeline.gpt_3b import gpt_3b

STEPS = 3


def _gathers_per_step(rank, world, plan):
    """All-gathers this rank's FSDP2 makes in each step."""
    import hetrain
    import torch.distributed as dist

    calls = [0]
    gather = dist.all_gather_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return gather(*args, **kwargs)

    dist.all_gather_single = counted   # FSDP2's all-gather (torch.distributed.fsdp's DefaultAllGather)
    session = hetrain.Session(plan)
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    per_step = []
    loader = session.loader(make_data(n=96), global_batch_size=plan.global_batch_size, shuffle=False)
    for x, y in loader:
        before = calls[0]
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        per_step.append(calls[0] - before)
        if session.step_count == STEPS:
            break
    session.close()
    return per_step


def _plans():
    one = pipeline_plan([[0, 4], [4, 8]], "1f1b", microbatches=4, global_batch=16, replica_shares=[8, 8])
    stages = [list(b) for b in interleaved_stages([4, 4], 2)]
    interleaved = one.model_copy(update={"pipeline": PipelinePlan(stages=stages, schedule="interleaved-1f1b",
                                                                  microbatches=4, chunks=2)})
    gpipe = pipeline_plan([[0, 4], [4, 8]], "gpipe", microbatches=4, global_batch=16, replica_shares=[8, 8])
    return {"1f1b": one, "interleaved": interleaved, "gpipe": gpipe}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "gpipe"])
def test_a_sharded_stage_gathers_each_block_once_per_micro_batch_and_once_more(schedule):
    plan = _plans()[schedule]
    results = run_ranks(_gathers_per_step, 4, plan.model_copy(update={"sharding": "fsdp"}))
    m, p = plan.pipeline.microbatches, plan.pipeline.ranks_per_pipeline
    for rank, per_step in enumerate(results):
        blocks = sum(b - a for a, b in plan.pipeline.stages[rank % p::p])   # each one FSDP2 unit of its own
        assert blocks == 4
        # the first step also runs torch's shape inference; every later step is alike
        assert per_step[1:] == [blocks * cm.sharded_stage_gathers(m)] * (STEPS - 1), (rank, per_step)

def test_the_planner_charges_a_sharded_hybrid_those_gathers(monkeypatch):
    """The sharded hybrid of test_pipeline_plans (a 3.3B model on 2 A100s and 2 V100s), at one micro-batch size:
    its predicted step grows by the same gather time for each gather counted, m + 1 of them."""
    def hybrid(gathers):
        monkeypatch.setattr(cm, "sharded_stage_gathers", gathers)
        result = plan_job(cluster_from_devices("a100-sxm4-40gb:2,v100-sxm2-32gb:2"), gpt_3b(layers=28, hidden=3072),
                          64, strategy="pipeline", micro_batch=4)
        return next(c for c in result.candidates if c.strategy == "hybrid")

    counted, none, one = hybrid(lambda m: m + 1), hybrid(lambda m: 0), hybrid(lambda m: 1)
    assert counted.plan.sharding == "fsdp" and counted.plan.pipeline == none.plan.pipeline == one.plan.pipeline
    m = counted.plan.pipeline.microbatches
    assert (counted.step_seconds - none.step_seconds) == pytest.approx((m + 1) * (one.step_seconds - none.step_seconds))
    assert one.step_seconds > none.step_seconds
