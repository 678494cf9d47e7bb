"""The model FLOPs behind MFU count the forwards of samples only: under FSDP2 with micro-batches, a rank's stand-in
pieces (rows run so that every rank's collectives meet, carrying no samples) inflated its FLOPs per sample by a
quarter; and a rank whose first forward was empty (no share yet) never reported MFU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.measured import FlopMeter
from tests.distributed import run_ranks


class _Records:
    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)


def _fsdp(rank: int, world: int) -> list[float]:
    import hetrain

    plan = Plan(global_batch_size=24, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=16, micro_batch=8), RankPlan(rank=1, share=8)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    seen = _Records()
    session.add_observer(seen)
    data = torch.utils.data.TensorDataset(torch.randn(24 * 4, 16), torch.randint(0, 4, (24 * 4,)))
    for x, y in session.loader(data, global_batch_size=24, shuffle=False):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
    session.close()
    return [r.model_flops / r.samples for r in seen.records]


def test_stand_in_pieces_are_not_model_flops(tmp_path):
    first, second = run_ranks(_fsdp, 2, env={"HETRAIN_RUN_DIR": str(tmp_path)})
    per_sample = 3 * 2 * (16 * 32 + 32 * 4)   # forward and backward of the two Linear layers' products
    assert first == second == [per_sample] * 4


def test_a_first_forward_without_samples_waits_for_one_with_them():
    net = torch.nn.Linear(16, 4)
    meter = FlopMeter(net)
    net(torch.randn(0, 16))   # a rank with no share yet
    assert meter.take_step_flops() is None
    net(torch.randn(8, 16))
    assert meter.take_step_flops() == 3 * 2 * 16 * 4 * 8


def _pipeline(rank: int, world: int, plan) -> list:
    import hetrain
    from tests.pipeline.common import make_data, make_model

    session = hetrain.Session(plan)
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = _Records()
    session.add_observer(seen)
    for x, y in session.loader(make_data(), global_batch_size=plan.global_batch_size, shuffle=False):
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        if session.step_count == 3:
            break
    session.close()
    return [(r.share, r.model_flops) for r in seen.records]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Two replicas of a two-stage pipeline, with a run directory: each rank's step records, and the directory."""
    from tests.pipeline.common import pipeline_plan

    run_dir = tmp_path_factory.mktemp("run")
    plan = pipeline_plan([[0, 4], [4, 8]], "gpipe", 1, 4, replica_shares=[3, 1])
    return run_ranks(_pipeline, 4, plan, env={"HETRAIN_RUN_DIR": str(run_dir)}), run_dir


def test_a_pipeline_stage_that_reads_no_samples_counts_the_flops_of_its_replicas_batch(hybrid):
    """A replica's batch is read spread over its stages' ranks: a stage that read none still computes the whole
    batch, and its FLOPs (and MFU) were dropped as a stand-in's (found in review)."""
    ranks, _ = hybrid
    # replica 1's one sample is read by one of its two stages' ranks: the other reads none
    for records in ranks:
        assert all(flops is not None and flops > 0 for _, flops in records), ranks


def test_the_run_log_and_the_report_name_each_pipeline_ranks_stage_and_replica(hybrid):
    """No view said which stage or replica a rank was, and the report printed an items/s column of 0.0 for every
    stage before the last (which computes no loss and counts no items), on a run that never passed num_items."""
    import json

    from hetrain.cli.report import print_table
    from hetrain.metrics.report import load_run, summary_rows
    from rich.console import Console

    _, run_dir = hybrid
    places = {}
    for r in range(4):
        start = json.loads((run_dir / "metrics" / f"rank-{r}.jsonl").read_text().splitlines()[0])
        assert start["kind"] == "start", start
        places[r] = (start["stage"], start["stages"], start["replica"], start["replicas"])
    assert sorted(places.values()) == [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)], places
    rows = summary_rows(load_run(run_dir))
    for row in rows:
        assert (row["stage"], row["stages"], row["replica"], row["replicas"]) == places[row["rank"]]
        assert (row["items_per_second"] is None) == (row["stage"] == 0), row
    console = Console(width=200, record=True)
    print_table(console, rows)
    table = console.export_text()
    assert "items/s" not in table, table   # the last stages' items are their samples
    assert "stage 0 of 2, replica 1" in table and "stage 1 of 2, replica 0" in table, table
