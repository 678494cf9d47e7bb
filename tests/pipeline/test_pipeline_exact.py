"""Pipeline and hybrid plans give the update of one process on the whole global batch (fp32)."""

import functools

import pytest

from hetrain.planning.plan import BalancePlan, Plan, RankPlan

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
    """Each rank seeds its own initialisation: a stage's replicas start from the first replica's weights
    (they trained apart, 5.05 off each other after 4 steps, before)."""
    plan = pipeline_plan([[0, 5], [5, 8]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[8, 4])
    results = run_ranks(train, 4, plan, STEPS, 6, False, None, False, True, True)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_same_script_runs_a_data_parallel_plan(sharding):
    """Seeded by rank too: DDP starts from rank 0's model, and so does FSDP2 (it sharded a mix before)."""
    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=7), RankPlan(rank=1, share=5)])
    results = run_ranks(train, 2, plan, STEPS, 6, False, None, False, True, True)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5


def test_mixed_precisions_per_stage():
    """Stage 0 in bf16, stage 1 in fp32, against one process running the same blocks in the same precisions."""
    plan = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=1, global_batch=GLOBAL, precisions=["bf16", "fp32"])
    results = run_ranks(train, 2, plan, STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL, bf16_blocks=3)) < 1e-5


def test_hybrid_token_mean_with_ignored_labels():
    """Micro-batches and replicas with different numbers of counted labels: the global label mean."""
    plan = pipeline_plan([[0, 4], [4, 8]], "gpipe", microbatches=4, global_batch=GLOBAL, replica_shares=[4, 8])
    results = run_ranks(train, 4, plan, STEPS, 6, True)
    assert worst_difference(results, reference(STEPS, GLOBAL, ignored=True)) < 1e-5


def test_hybrid_with_fsdp2_inside_stages():
    """Each stage sharded (FSDP2) over its 2 replicas, replicas with unequal shares."""
    plan = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[8, 4])
    plan = plan.model_copy(update={"sharding": "fsdp"})
    results = run_ranks(train, 4, plan, STEPS, 6, False, None, False, True, True)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5


def test_activation_checkpointing_on_a_stage():
    plan = pipeline_plan([[0, 2], [2, 8]], "1f1b", microbatches=4, global_batch=GLOBAL)
    ranks = [plan.ranks[0], plan.ranks[1].model_copy(update={"activation_checkpointing": True})]
    results = run_ranks(train, 2, plan.model_copy(update={"ranks": ranks}), STEPS)
    assert worst_difference(results, reference(STEPS, GLOBAL)) < 1e-5
    assert set(results[1]["states"][0]) == {k for k in reference(1, GLOBAL)[0] if not k.startswith(("0.", "1."))}
    assert results[0]["checkpointed"] == 0 and results[1]["checkpointed"] == 6   # stage 1's blocks recompute


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_partial_last_batch_changes_the_micro_batch_shape_and_the_next_epoch_changes_it_back(ranks):
    """96 samples in global batches of 36 (drop_last=False): micro-batches of 9, then 6 at the epoch's
    partial batch, then 9 again; each shape gets stages of its own (it crashed the next full step)."""
    stages = [[0, 3], [3, 8]] if ranks == 2 else [[0, 2], [2, 5], [5, 8]]
    plan = pipeline_plan(stages, "1f1b", microbatches=4, global_batch=36)
    results = run_ranks(functools.partial(train, drop_last=False), ranks, plan, 5)
    assert worst_difference(results, reference(5, 36, drop_last=False)) < 1e-5


def _token_mean_first_steps(rank, world):
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import hetrain
    from tests.pipeline.common import CLASSES, FEATURES, count_labels, make_model

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 256, FEATURES, generator=g), torch.randint(0, CLASSES, (16, 256), generator=g)
    y[:, 200:] = -100   # 200 of 256 tokens count
    session = hetrain.Session(pipeline_plan([[0, 4], [4, 8]], "1f1b", 2, 8, precisions=["fp16", "fp32"]))
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    applied, scales = [], []
    for xb, yb in session.loader(TensorDataset(x, y), global_batch_size=8, shuffle=False):
        session.forward_backward(xb, yb, lambda out, t: F.cross_entropy(out.float().reshape(-1, CLASSES),
                                                                         t.reshape(-1), ignore_index=-100),
                                 num_items=count_labels)
        applied.append(session.step())
        scales.append(session.scaler.scale)
    session.close()
    return applied, scales


def test_a_token_mean_does_not_overflow_the_first_fp16_step_of_a_pipeline():
    """The first step assumed one item per sample: 200 tokens a sample weighed 200 times too much and the fp16
    stage overflowed (step 1 skipped, the scale halved)."""
    for applied, scales in run_ranks(_token_mean_first_steps, 2):
        assert applied == [True, True] and scales == [2.0**16, 2.0**16], (applied, scales)


def _draws_after_prepare(rank, world, plan):
    import torch

    import hetrain
    from tests.pipeline.common import make_model

    session = hetrain.Session(plan)
    torch.manual_seed(0)   # every rank seeded alike, as the script does
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    draws = torch.rand(8)   # what a stage's dropout would draw first
    session.close()
    return draws


def test_each_stage_draws_its_own_dropout_masks():
    """Seeded alike, stage 1 drew exactly stage 0's dropout masks for the same samples (8 of 8 equal)."""
    import torch

    plan = pipeline_plan([[0, 4], [4, 8]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[6, 6])
    draws = run_ranks(_draws_after_prepare, 4, plan)
    stage = {r.rank: r.stage for r in plan.ranks}
    by_stage = {s: [draws[r] for r in stage if stage[r] == s] for s in set(stage.values())}
    assert not torch.equal(by_stage[0][0], by_stage[1][0])
    assert all(torch.equal(d, ds[0]) for ds in by_stage.values() for d in ds)   # a stage's replicas alike, as DDP's


def _evaluate_between_steps(rank, world, plan):
    import torch
    import torch.nn.functional as F

    import hetrain
    from tests.pipeline.common import LR, make_data, make_model

    session = hetrain.Session(plan)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    x, y = make_data(n=20, seed=5).tensors
    mine = slice(rank * 20 // world, (rank + 1) * 20 // world)   # each rank its part of the evaluation set
    losses = []
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0)
    for step, (bx, by) in enumerate(loader):
        model.eval()
        losses.append(session.evaluate(x[mine], y[mine], F.cross_entropy))
        model.train()
        session.forward_backward(bx, by, F.cross_entropy)
        session.step()
        if step == 1:
            break
    losses.append(session.evaluate(x[mine], y[mine], F.cross_entropy))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in getattr(model, "module", model).state_dict().items()}
    session.close()
    return {"losses": losses, "states": [{k: v.detach().clone() for k, v in state.items()}]}


@pytest.mark.parametrize("plan", ["pipeline", "data parallel"])
def test_evaluate_between_steps_gives_one_processs_validation_loss(plan):
    """Under a pipeline no rank can run model(x): evaluation had no way to run there."""
    import torch
    import torch.nn.functional as F

    from tests.pipeline.common import make_data, make_model

    plan = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=2, global_batch=GLOBAL) if plan == "pipeline" else \
        Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
             ranks=[RankPlan(rank=0, share=7), RankPlan(rank=1, share=5)])
    results = run_ranks(_evaluate_between_steps, 2, plan)
    want = reference(2, GLOBAL)
    x, y = make_data(n=20, seed=5).tensors
    expected = []
    for state in [make_model().state_dict(), *want]:
        net = make_model()
        net.load_state_dict(state)
        with torch.no_grad():
            expected.append(float(F.cross_entropy(net.eval()(x), y)))
    for r in results:
        assert r["losses"] == pytest.approx(expected, abs=1e-5), (r["losses"], expected)
    assert worst_difference([{"states": r["states"]} for r in results], want[-1:]) < 1e-5   # training unchanged
