"""Interleaved 1F1B (torch's ScheduleInterleaved1F1B): each rank holds several chunks of blocks whose
sizes add up to its uneven share; the update equals one process on the whole global batch (fp32)."""

import pytest

from hetrain.errors import HetrainError
from hetrain.planning.partition import interleaved_stages
from hetrain.planning.plan import PipelinePlan

from tests.distributed import run_ranks
from tests.pipeline.common import pipeline_plan, reference, train, worst_difference

STEPS, GLOBAL = 3, 12


def interleaved(blocks_per_rank: list[int], chunks: int, microbatches: int, **kw):
    """Ranks 0..p-1 are replica 0's, p..2p-1 replica 1's; each rank's blocks in `chunks` chunks."""
    p = len(blocks_per_rank)
    plan = pipeline_plan([[0, 1]] * p, "1f1b", microbatches, GLOBAL, **kw)   # the ranks and their shares
    stages = [list(b) for b in interleaved_stages(blocks_per_rank, chunks)]
    pipeline = PipelinePlan(stages=stages, schedule="interleaved-1f1b", microbatches=microbatches, chunks=chunks)
    return plan.model_copy(update={"pipeline": pipeline})


def test_chunks_add_up_to_each_ranks_share():
    assert interleaved_stages([6, 3, 3], 3) == [(0, 2), (2, 3), (3, 4)] * 1 + [(4, 6), (6, 7), (7, 8)] + \
        [(8, 10), (10, 11), (11, 12)]
    assert interleaved_stages([5, 3], 2) == [(0, 3), (3, 5), (5, 7), (7, 8)]
    with pytest.raises(HetrainError, match="at least 2 blocks"):
        interleaved_stages([3, 1], 2)


def test_plan_checks_chunks_against_the_schedule():
    with pytest.raises(ValueError, match="interleaved-1f1b"):
        PipelinePlan(stages=[[0, 1], [1, 2], [2, 3], [3, 4]], schedule="1f1b", chunks=2)
    with pytest.raises(ValueError, match="chunks per rank"):
        PipelinePlan(stages=[[0, 1], [1, 2], [2, 4]], schedule="interleaved-1f1b", chunks=2)


def test_two_ranks_uneven_chunks():
    """Rank 0 holds blocks 0-2 and 5-6 (5 blocks), rank 1 blocks 3-4 and 7 (3 blocks)."""
    plan = interleaved([5, 3], chunks=2, microbatches=4)
    results = run_ranks(train, 2, plan, STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5
    assert sorted(results[0]["states"][0]) == sorted(k for k in reference(1, GLOBAL)[0]
                                                     if k.split(".")[0] in {"0", "1", "2", "5", "6"})


def test_three_ranks_uneven_chunks_with_ignored_labels():
    plan = interleaved([4, 2, 2], chunks=2, microbatches=6)
    results = run_ranks(train, 3, plan, STEPS, 6, True)
    assert worst_difference(results, reference(STEPS, GLOBAL, ignored=True)) < 1e-5


def test_hybrid_of_interleaved_pipelines_unequal_shares():
    plan = interleaved([5, 3], chunks=2, microbatches=2,
                       replica_shares=[8, 4])
    results = run_ranks(train, 4, plan, STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5


def test_resume_equals_the_uninterrupted_run(tmp_path):
    import shutil

    from tests.pipeline.test_pipeline_resume import TWO, final_model

    plan = interleaved([4, 2, 2], chunks=2, microbatches=3)
    whole = final_model(run_ranks(train, 3, plan, 4, 6, False, None, True))
    run_ranks(train, 3, plan, 2, 6, False, str(tmp_path / "a"), True)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = run_ranks(train, 3, plan, 4, 6, False, str(tmp_path / "a"), True)
    assert len(resumed[0]["states"]) == 2          # steps 3 and 4 only: it continued from step 2
    again = final_model(resumed)
    assert again.keys() == whole.keys()
    assert all(bool((again[k] == whole[k]).all()) for k in whole)   # bit-exact on the same layout
    # the same checkpoint on two GPipe stages (another layout)
    other = final_model(run_ranks(train, 2, TWO, 4, 6, False, str(tmp_path / "b"), True))
    assert other.keys() == whole.keys()
    assert max((other[k] - whole[k]).abs().max().item() for k in whole) < 1e-5


def test_hybrid_with_fsdp2_inside_interleaved_stages():
    """Each chunk sharded (FSDP2) over its 2 replicas, replicas with unequal shares."""
    plan = interleaved([5, 3], chunks=2, microbatches=2, replica_shares=[8, 4])
    results = run_ranks(train, 4, plan.model_copy(update={"sharding": "fsdp"}), STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5


def test_interleaved_stages_on_decreasing_ranks_are_refused_with_the_fix():
    from hetrain.runtime.pipeline_stages import pipeline_layout

    plan = interleaved([5, 3], chunks=2, microbatches=4)
    swapped = [r.model_copy(update={"stage": 1 - r.stage}) for r in plan.ranks]
    with pytest.raises(HetrainError, match=r"came in another order than the plan's \(rank 0: .* \(stage 1\), "
                                           r"rank 1: .* \(stage 0\)\).*--devices lists rank 0's first"):
        pipeline_layout(swapped, plan.pipeline, 0)
    assert pipeline_layout(plan.ranks, plan.pipeline, 1).stage == 1
