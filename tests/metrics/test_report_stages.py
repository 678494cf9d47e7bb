"""hetrain report on a pipeline rank that a resume moved to another stage: items/s counts the steps it ran as the
last stage only (a stage before the last computes no loss and counts no items)."""

import pytest

from hetrain.metrics.report import Attempt, RankRun, summary_row


def _step(step: int, items: int) -> dict:
    return {"step": step, "device": "cpu", "samples": 8, "items": items, "step_seconds": 1.0, "share": 8,
            "shares": [8, 8], "compute_seconds": 0.5, "waiting_seconds": 0.5, "data_wait_seconds": 0.0}


@pytest.mark.parametrize("first, then", [(1, 0), (0, 1)], ids=["last stage, then first", "first stage, then last"])
def test_items_per_second_counts_the_steps_the_rank_ran_as_the_last_stage(first, then):
    starts = [Attempt(start={"device": "cpu", "stage": s, "stages": 2, "replica": 0, "replicas": 1}) for s in (first, then)]
    items = {0: 0, 1: 8}   # a last stage counts its 8 samples' items; a first stage none
    run = RankRun(0, starts, [_step(i, items[first]) for i in range(1, 5)] + [_step(i, items[then]) for i in range(5, 9)],
                  [0] * 4 + [1] * 4)
    row = summary_row(run)
    assert row["items_per_second"] == pytest.approx(8.0), row   # 32 items over the 4 s it ran as the last stage
    assert row["stage"] == then and row["samples_per_second"] == pytest.approx(8.0)
