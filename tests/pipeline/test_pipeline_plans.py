"""The planner's pipeline plans: chosen when the model fits no single device, explained, and run by the runtime."""

import math

import pytest
import torch


from hetrain.hardware.cluster import cluster_from_devices, get_preset
from hetrain.planning.cost_model import pipeline_bubble
from hetrain.planning.planner import plan_job
from hetrain.planning.plan import PipelinePlan
from hetrain.vocabulary import PIPELINE_STRATEGIES
from hetrain.workload.zoo import get_profile
from tests.distributed import run_ranks
from tests.pipeline.common import make_model, pipeline_plan, reference, train
from tests.pipeline.gpt_3b import gpt_3b

CLUSTER = "a100-sxm4-40gb:4,v100-sxm2-32gb:4"


def plan_3b():
    """The planner's pipeline for a 3B model on 4 A100s and 4 V100s at 512 samples per step."""
    return plan_job(cluster_from_devices(CLUSTER), gpt_3b(), 512, strategy="pipeline").plan


def hybrid_3b():
    """The planner's best hybrid (replicated pipeline) for the same job."""
    result = plan_job(cluster_from_devices(CLUSTER), gpt_3b(), 512, strategy="pipeline")
    return next(c.plan for c in result.candidates if c.strategy == "hybrid" and c.feasible)


def test_bubble_formula():
    assert pipeline_bubble(1, 8) == 0.0
    assert math.isclose(pipeline_bubble(3, 8), 2 / 10)


def test_auto_weighs_pipelines_for_a_3b_model():
    """The model fits on no single device: auto weighs pipelines (bubble included) against ZeRO-3 and
    keeps the faster; either is a plan the runtime runs."""
    result = plan_job(cluster_from_devices(CLUSTER), gpt_3b(), 512, strategy="auto")
    assert any("fits on no single device; pipelines considered" in n for n in result.plan.notes)
    cands = {c.strategy: c for c in result.candidates}
    assert cands["pipeline"].feasible and cands["zero3"].feasible
    assert result.plan.strategy == max((cands[s] for s in ("zero3", "pipeline", "hybrid")),
                                       key=lambda c: c.samples_per_s).strategy


def test_auto_with_zero_for_a_model_one_device_holds_weighs_pipelines_and_names_the_faster_one():
    """GPT-2 1.5B fits on an A100 80 GB but not, with plain data parallelism, on a V100 32 GB: auto
    weighs pipelines beside ZeRO but keeps to ZeRO (a data-parallel plan runs any script); on two
    nodes over 100 Gb/s, where ZeRO's traffic crosses the network, the pipeline it weighed is faster,
    and a note gives its figure, what a pipeline needs of the script, and the flag that takes it."""
    cluster, profile = get_preset("a100x4+v100x4"), get_profile("gpt2-1.5b")
    auto = plan_job(cluster, profile, 64, strategy="auto")
    cands = {c.strategy: c for c in auto.candidates}
    assert auto.plan.strategy in ("zero1", "zero3") and not cands["balanced"].feasible
    forced = plan_job(cluster, profile, 64, strategy="pipeline")
    assert forced.plan.strategy in PIPELINE_STRATEGIES
    assert forced.plan.predicted_samples_per_s > auto.plan.predicted_samples_per_s
    # the auto plan weighed the same pipeline the forced one chose
    assert cands[forced.plan.strategy].samples_per_s == pytest.approx(forced.plan.predicted_samples_per_s)
    note = next(n for n in auto.plan.notes if n.startswith(f"not {forced.plan.strategy}, predicted"))
    assert f"{forced.plan.predicted_samples_per_s:.1f} samples/s" in note
    assert "session.forward_backward" in note and "nn.Sequential" in note and "--strategy pipeline" in note
    # where plain data parallelism fits every device, pipelines are not weighed, and the table says so
    small = plan_job(cluster, get_profile("gpt2-124m"), 64, strategy="auto")
    small_cands = {c.strategy: c for c in small.candidates}
    assert not small_cands["pipeline"].feasible and "--strategy pipeline" in small_cands["pipeline"].reason
    assert not any(n.startswith("not pipeline") or n.startswith("not hybrid") for n in small.plan.notes)
    # of the two pipeline shapes, only the faster is named: one flag weighs both
    assert sum(n.startswith(("not pipeline", "not hybrid")) for n in auto.plan.notes) == 1
    # a strategy asked for by name weighs no pipeline, and says that was why
    zero3 = plan_job(cluster, profile, 64, strategy="zero3")
    assert "--strategy zero3 was asked for" in {c.strategy: c for c in zero3.candidates}["pipeline"].reason


def test_a_pipeline_plan_for_a_3b_model_says_why():
    plan = plan_3b()
    assert plan.strategy in PIPELINE_STRATEGIES and plan.pipeline is not None
    assert plan.sharding == "none"
    p, m, v = plan.pipeline.ranks_per_pipeline, plan.pipeline.microbatches, plan.pipeline.chunks
    bubble = f"{pipeline_bubble(p, m, v):.1%}"
    formula = "(p-1)/(m+p-1)" if v == 1 else "(p-1)/(v*m+p-1)"
    assert any(f"predicted bubble {formula} = {bubble}" in n for n in plan.notes), plan.notes
    # the partition covers the 34 blocks in order, stages of unequal size
    assert plan.pipeline.stages[0][0] == 0 and plan.pipeline.stages[-1][1] == 34
    assert len({b - a for a, b in plan.pipeline.stages}) > 1


def _scaled(plan, global_batch: int, microbatches: int):
    """The plan's devices, precisions, partition and replica shares; a global batch CPU ranks can run."""
    scale = global_batch / plan.global_batch_size
    ranks = [r.model_copy(update={"share": round(r.share * scale), "micro_batch": None, "grad_accum": 1})
             for r in plan.ranks]
    pipeline = plan.pipeline.model_copy(update={"microbatches": microbatches})
    return plan.model_copy(update={"global_batch_size": global_batch, "ranks": ranks, "pipeline": pipeline})


def _runs_with_the_global_update(plan, layers: int) -> None:
    """The plan on CPU ranks: one global loss on every rank, every block held by some stage, and each
    parameter's update that of one process on the whole batch (within low-precision rounding)."""
    results = run_ranks(train, plan.world_size, plan, 1, layers, timeout=240)
    want = reference(1, plan.global_batch_size, layers=layers)[0]
    start = make_model(layers).state_dict()
    losses = [l for r in results for l in r["losses"]]
    assert all(math.isfinite(l) for l in losses) and len(set(losses)) == 1
    assert {k for r in results for k in r["states"][0]} == set(want)     # every block ran on some stage
    for r in results:
        for k, v in r["states"][0].items():
            moved = (want[k] - start[k]).abs().max().item()
            assert (v - want[k]).abs().max().item() <= 0.1 * moved + 1e-3   # low precision, same update


def test_the_3b_plan_runs_on_cpu_ranks_scaled_down():
    """Every rank of the plan (its devices' precisions, bf16 and fp16 with one loss scale) on a 34-block model."""
    _runs_with_the_global_update(_scaled(plan_3b(), global_batch=16, microbatches=8), layers=32)


def test_the_3b_hybrid_plan_runs_on_cpu_ranks_scaled_down():
    """The planner's replicated pipeline: replicas of stages on A100s and V100s, the global-batch update."""
    plan = _scaled(hybrid_3b(), global_batch=16, microbatches=2)
    assert plan.strategy == "hybrid" and len(plan.pipeline.stages) < plan.world_size
    _runs_with_the_global_update(plan, layers=32)


def test_plans_the_runtime_cannot_run_are_refused_with_the_fix():
    import pytest

    import hetrain
    from hetrain.errors import HetrainError
    from hetrain.planning.plan import Plan, RankPlan

    missing = Plan(global_batch_size=8, strategy="pipeline", pipeline=PipelinePlan(stages=[[0, 2], [2, 4]]),
                   ranks=[RankPlan(rank=0, share=8)])
    with pytest.raises(HetrainError, match=r"stages have \[1, 0\] ranks.*--strategy pipeline"):
        hetrain.Session(missing)
    sharded = pipeline_plan([[0, 2], [2, 8]], "1f1b", 4, 12).model_copy(update={"sharding": "zero1"})
    with pytest.raises(HetrainError, match="inside pipeline stages, where hetrain runs FSDP2 only"):
        hetrain.Session(sharded)
    no_partition = Plan(global_batch_size=8, strategy="pipeline", ranks=[RankPlan(rank=0, share=8, stage=1)])
    with pytest.raises(HetrainError, match="no pipeline partition"):
        hetrain.Session(no_partition)


def test_a_pipeline_needs_a_global_batch_of_at_least_its_ranks():
    """The session reads part of each global batch on every rank, so the planner asks for it up front."""
    import pytest

    from hetrain.errors import HetrainError

    with pytest.raises(HetrainError, match="at least 8"):
        plan_job(cluster_from_devices(CLUSTER), gpt_3b(), 4, strategy="pipeline")


def test_interleaving_pays_where_the_bubble_outweighs_the_transfers():
    """Few micro-batches over 4 stages: the planner cuts each device's blocks into chunks (interleaved
    1F1B), and the plan it writes runs on CPU ranks, scaled down, with the global-batch update."""
    result = plan_job(cluster_from_devices("a100-sxm4-80gb:2,v100-sxm2-32gb:2"), gpt_3b(), 16, strategy="pipeline")
    pipe = next(c for c in result.candidates if c.strategy == "pipeline" and c.feasible)
    pipeline = pipe.plan.pipeline
    assert pipeline.schedule == "interleaved-1f1b" and pipeline.chunks > 1
    assert any(f"(p-1)/(v*m+p-1) = {pipeline_bubble(4, pipeline.microbatches, pipeline.chunks):.1%}" in n
               for n in pipe.notes)
    # each device's chunks hold its share of the speed-sized partition: the A100s more than the V100s
    held = [sum(b - a for a, b in pipeline.stages[j::4]) for j in range(4)]
    assert sum(held) == 34 and min(held[:2]) > max(held[2:])
    _runs_with_the_global_update(_scaled(pipe.plan, global_batch=16, microbatches=8), layers=32)


def test_stages_too_big_for_their_replicas_are_sharded_with_fsdp2():
    """A 3.3B model on 2 A100s and 2 V100s: a 2-stage pipeline replicated twice fits only with each stage
    sharded (FSDP2, ZeRO-3) over its 2 replicas; the planner says so, and the plan runs on CPU ranks."""
    model = gpt_3b(layers=28, hidden=3072)
    result = plan_job(cluster_from_devices("a100-sxm4-40gb:2,v100-sxm2-32gb:2"), model, 64, strategy="pipeline")
    hybrid = next(c for c in result.candidates if c.strategy == "hybrid")
    assert hybrid.feasible and hybrid.plan.sharding == "fsdp"
    assert any("sharded with FSDP2 (ZeRO-3) over its 2 replicas" in n for n in hybrid.notes)
    assert all(r.memory_bytes <= r.memory_capacity_bytes for r in hybrid.plan.ranks)
    pipe = next(c for c in result.candidates if c.strategy == "pipeline")
    assert pipe.plan.sharding == "none"                    # one replica: nothing to shard over
    _runs_with_the_global_update(_scaled(hybrid.plan, global_batch=16, microbatches=2), layers=28)


def _held_through_the_step(profile, plan, rank) -> float:
    """What a stage sharded over d replicas holds through a step whatever its micro-batches: torch's
    PipelineStage runs every backward with set_reshard_after_backward(False) and
    set_requires_gradient_sync(False), reduce-scattering once after the last, so every weight stays
    gathered in fp32 beside its shard and every gradient unsharded beside its reduce-scattered shard."""
    p = plan.pipeline.ranks_per_pipeline
    d = plan.world_size // p
    ranges = plan.pipeline.stages[rank.stage::p]
    params = sum(profile.held_params(a, b) for a, b in ranges)
    trained = sum(profile.held_trained_params(a, b) for a, b in ranges)
    return 4.0 * (1 + 1 / d) * (params + trained)


@pytest.mark.parametrize("devices, model, global_batch, hybrid_fits", [
    ("v100-sxm2-16gb:8", get_profile("gpt3-2.7b"), 64, False),
    ("a100-sxm4-40gb:2,v100-sxm2-32gb:2", gpt_3b(layers=28, hidden=3072), 64, True),
])
def test_a_sharded_stage_is_planned_with_its_weights_gathered_through_the_step(devices, model, global_batch,
                                                                                 hybrid_fits):
    """GPT-3 2.7B on 8 V100 16 GB at 64: a hybrid whose stages are sharded over 4 replicas was planned at
    13.2 and 12.0 GB, counting one gathered block and its unsharded gradients, where the stages hold all
    theirs through a step (22.2 and 21.0 GB); it fits no 16 GB, and the 1-replica pipeline is chosen."""
    result = plan_job(cluster_from_devices(devices), model, global_batch, strategy="pipeline")
    hybrid = next(c for c in result.candidates if c.strategy == "hybrid")
    assert hybrid.feasible == hybrid_fits
    if hybrid.feasible and hybrid.plan.sharding == "fsdp":
        for r in hybrid.plan.ranks:
            assert _held_through_the_step(model, hybrid.plan, r) <= r.memory_bytes <= r.memory_capacity_bytes


def test_the_cli_plan_for_gpt3_2_7b_is_accepted_and_runs_scaled_down(tmp_path):
    """`hetrain plan --devices a100-sxm4-40gb:4,v100-sxm2-32gb:4 --model gpt3-2.7b --global-batch-size 512`
    (auto): the plan it writes validates, and its devices, precisions and partition of the 34 blocks
    run on 8 CPU ranks with the global-batch update."""
    import subprocess
    import sys

    from hetrain.planning.plan import Plan

    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "plan", "--devices", CLUSTER, "--model", "gpt3-2.7b",
                        "--global-batch-size", "512", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = Plan.model_validate_json(out.read_text())
    assert plan.world_size == 8 and plan.global_batch_size == 512
    assert plan.strategy in PIPELINE_STRATEGIES, f"auto chose {plan.strategy}: {plan.notes}"   # (pipeline today)
    assert plan.pipeline.stages[0][0] == 0 and plan.pipeline.stages[-1][1] == 34
    _runs_with_the_global_update(_scaled(plan, global_batch=16, microbatches=8), layers=32)


def test_a_pipeline_step_includes_each_stage_optimizer_step():
    """After the last backward every stage steps its optimizer over its own blocks: a rank's predicted
    step grows by its stage's optimizer pass (as a data-parallel rank's grows by the whole model's),
    and the job's by the slowest stage's."""
    from hetrain.hardware.catalog import get_gpu
    from hetrain.planning.cost_model import OPTIMIZER_STEP_BYTES

    from hetrain.workload import get_profile

    # a model every stage holds with room to spare: the optimizer's state does not change the partition
    profile, cluster = get_profile("gpt2-124m"), cluster_from_devices("a100-sxm4-80gb:2,v100-sxm2-32gb:2")
    adam = plan_job(cluster, profile, 64, strategy="pipeline", optimizer="adamw").plan
    sgd = plan_job(cluster, profile, 64, strategy="pipeline", optimizer="sgd-nomomentum").plan
    assert adam.pipeline == sgd.pipeline and [r.micro_batch for r in adam.ranks] == [r.micro_batch for r in sgd.ranks]
    extra = OPTIMIZER_STEP_BYTES["adamw"] - OPTIMIZER_STEP_BYTES["sgd-nomomentum"]
    added = []
    for a, s in zip(adam.ranks, sgd.ranks):
        p = adam.pipeline.ranks_per_pipeline   # a rank holds stages j, j + p, ... (interleaved 1F1B)
        params = sum(profile.held_params(first, last) for first, last in adam.pipeline.stages[a.stage::p])
        added.append(extra * params / get_gpu(a.device).mem_bw_bytes_per_s)
        assert a.predicted_step_seconds - s.predicted_step_seconds == pytest.approx(added[-1], rel=1e-6)
    assert min(added) > 0
    assert 64 / adam.predicted_samples_per_s - 64 / sgd.predicted_samples_per_s == pytest.approx(max(added), rel=1e-6)


@pytest.mark.parametrize("global_batch, micro_batch", [(13, 3), (30, 4), (50, 3), (100, 3)])
def test_a_pipeline_plan_writes_the_micro_batch_count_the_runtime_runs(global_batch, micro_batch):
    """The runtime lowers a count that does not divide the batch (every micro-batch has one shape): the
    plan writes one it keeps, of micro-batches no larger than asked, and prices those."""
    from hetrain.planning.partition import microbatches_for

    plan = plan_job(cluster_from_devices("a100:1,v100:1"), get_profile("gpt2-124m"), global_batch,
                    strategy="pipeline", micro_batch=micro_batch).plan
    m = plan.pipeline.microbatches
    interleaved = plan.pipeline.ranks_per_pipeline if plan.pipeline.schedule == "interleaved-1f1b" else None
    assert microbatches_for(global_batch, m, interleaved) == m and global_batch % m == 0
    assert all(r.micro_batch == global_batch // m <= micro_batch for r in plan.ranks)



def test_the_counts_the_runtime_keeps_for_a_prime_batch():
    """A prime batch keeps only 1 or all of its samples per micro-batch: the count asked for rounds up to it."""
    from hetrain.planning.partition import microbatches_at_most, microbatches_for

    assert microbatches_at_most(6007, 3) == 6007 and microbatches_for(6007, 2003) == 1
    assert microbatches_at_most(6006, 4) == 2002 and microbatches_for(6006, 2002) == 2002


def _dict_inputs(rank, world, plan):
    import torch.nn.functional as F

    import hetrain
    from hetrain.errors import HetrainError
    from tests.pipeline.common import make_data

    session = hetrain.Session(plan)
    net = make_model()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=plan.global_batch_size, shuffle=False)
    x, y = next(iter(loader))
    errors = []
    for call in (lambda: session.evaluate({"x": x}, y, F.cross_entropy),
                 lambda: session.forward_backward({"x": x}, y, F.cross_entropy)):
        try:
            call()
            errors.append(None)
        except HetrainError as e:
            errors.append(str(e))
    session.close()
    return errors


def test_a_dict_of_inputs_under_a_pipeline_is_refused_naming_the_tuple_to_pass():
    """A Hugging Face habit (model(**batch)) cannot reach a pipeline's first stage, which takes positional
    tensors: evaluation and training both say to pass a tuple, on every rank."""
    plan = pipeline_plan([[0, 4], [4, 8]], "1f1b", 2, 8)
    for errors in run_ranks(_dict_inputs, 2, plan):
        assert len(errors) == 2 and all(e is not None and "a dict of inputs under a pipeline plan" in e
                                        and "(batch['input_ids'],)" in e for e in errors), errors


def _direct_call(rank, world, plan):
    import hetrain
    from hetrain.errors import HetrainError
    from tests.pipeline.common import make_data

    session = hetrain.Session(plan)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, _ = next(iter(session.loader(make_data(), global_batch_size=plan.global_batch_size, shuffle=False)))
    try:
        with torch.no_grad():
            model(x)   # an evaluation habit
        error = None
    except HetrainError as e:
        error = str(e)
    session.close()
    return error


def test_a_direct_call_under_a_pipeline_names_the_calls_for_training_evaluating_and_saving():
    """An evaluation's model(x) under no_grad was told to use forward_backward, a training call."""
    plan = pipeline_plan([[0, 4], [4, 8]], "1f1b", 2, 8)
    for error in run_ranks(_direct_call, 2, plan):
        assert error is not None and "session.forward_backward(inputs, target, loss_fn)" in error
        assert "session.evaluate(inputs, target, loss_fn)" in error and "session.model_state_dict()" in error


def test_a_partition_that_leaves_a_stage_empty_or_a_gap_is_refused_naming_it():
    import pytest
    from torch import nn

    from hetrain.errors import HetrainError
    from hetrain.planning.plan import PipelinePlan
    from hetrain.runtime.pipeline_stages import model_blocks

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])
    assert len(model_blocks(model, PipelinePlan(stages=[[0, 2], [2, 6]]))) == 6
    with pytest.raises(HetrainError, match=r"stage 1 \(\[6, 6\]\) holds no block"):
        model_blocks(model, PipelinePlan(stages=[[0, 6], [6, 6]]))
    with pytest.raises(HetrainError, match="do not cover the model's 6 blocks in order"):
        model_blocks(model, PipelinePlan(stages=[[0, 2], [3, 6]]))
