"""The model FLOPs a pipeline rank reports (its MFU) are its blocks' work on the step's samples, exactly: every
chunk of an interleaved schedule counts (torch calls the chunks, not the rank's module that holds them all: such a
rank reported no FLOPs at all), and torch's shape inference, a forward of its own on a new schedule's first step,
counts none (the first step and an epoch's partial last batch counted one micro-batch too many: 1.25 x with 4)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hetrain.runtime.measured import FlopMeter
from tests.distributed import run_ranks
from tests.pipeline.common import CLASSES, FEATURES, WIDTH, make_data, make_model, pipeline_plan

# forward FLOPs per sample (2 x in x out per Linear; FlopCounterMode counts no LayerNorm) of the 8 blocks
EMBED, LAYER, HEAD = 2 * FEATURES * WIDTH, 2 * WIDTH * WIDTH, 2 * WIDTH * CLASSES


def _flops(rank: int, world: int, plan, samples: int) -> list[tuple[int, float | None]]:
    import hetrain
    from tests.metrics.step_records import StepRecords

    session = hetrain.Session(plan)
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = StepRecords()
    session.add_observer(seen)
    loader = session.loader(make_data(samples), global_batch_size=plan.global_batch_size, shuffle=False,
                            drop_last=False)
    for x, y in loader:
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
    session.close()
    return [(r.samples, r.model_flops) for r in seen.records]


def _check(ranks: list[list[tuple[int, float | None]]], per_sample: list[int]) -> None:
    for records, forward in zip(ranks, per_sample):
        assert [samples for samples, _ in records] == [24, 24, 24, 12]   # the last a new shape: 4 micro-batches of 3
        for samples, flops in records:
            assert flops == pytest.approx(3 * forward * samples, rel=1e-9), (forward, records)


def test_the_first_step_and_a_partial_last_batch_count_no_shape_inference(tmp_path):
    plan = pipeline_plan([[0, 4], [4, 8]], "1f1b", 4, 24)
    ranks = run_ranks(_flops, 2, plan, 84, env={"HETRAIN_RUN_DIR": str(tmp_path)})
    _check(ranks, [EMBED + 3 * LAYER, 3 * LAYER + HEAD])


def test_an_interleaved_rank_counts_the_flops_of_each_of_its_chunks(tmp_path):
    plan = pipeline_plan([[0, 2], [2, 4], [4, 6], [6, 8]], "interleaved-1f1b", 4, 24)
    plan = plan.model_copy(update={"ranks": plan.ranks[:2], "pipeline": plan.pipeline.model_copy(update={"chunks": 2})})
    ranks = run_ranks(_flops, 2, plan, 84, env={"HETRAIN_RUN_DIR": str(tmp_path)})
    _check(ranks, [EMBED + 3 * LAYER, 3 * LAYER + HEAD])   # rank 0: stages 0 and 2; rank 1: stages 1 and 3


def test_a_meter_over_several_modules_sums_them_once_each_has_run():
    first, second = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    meter = FlopMeter([first, second])
    first(torch.randn(5, 8))
    assert meter.take_step_flops() is None   # the second has not run: its FLOPs are unknown
    second(first(torch.randn(3, 8)))
    assert meter.take_step_flops() == 3 * 2 * (8 * 4 + 4 * 2) * 3
