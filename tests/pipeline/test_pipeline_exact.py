"""Pipeline and hybrid plans give the update of one process on the whole global batch (fp32)."""

import pytest

from tests.distributed import run_ranks
from tests.pipeline.common import pipeline_plan, reference, train, worst_difference

STEPS, GLOBAL = 3, 12


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_uneven_stages(schedule):
    plan = pipeline_plan([[0, 2], [2, 8]], schedule, microbatches=4, global_batch=GLOBAL)
    results = run_ranks(train, 2, plan, STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5
    assert abs(results[0]["losses"][0] - results[1]["losses"][0]) == 0.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_uneven_stages(schedule):
    plan = pipeline_plan([[0, 1], [1, 6], [6, 8]], schedule, microbatches=3, global_batch=GLOBAL)
    results = run_ranks(train, 3, plan, STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5


def test_hybrid_two_replicas_unequal_shares():
    plan = pipeline_plan([[0, 5], [5, 8]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[8, 4])
    results = run_ranks(train, 4, plan, STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5
