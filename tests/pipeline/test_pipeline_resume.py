"""A pipeline run resumed from its checkpoint continues exactly, on the same or on another stage layout."""

from tests.distributed import run_ranks
from tests.pipeline.common import pipeline_plan, train

GLOBAL = 12
THREE = pipeline_plan([[0, 1], [1, 6], [6, 8]], "1f1b", microbatches=3, global_batch=GLOBAL)
TWO = pipeline_plan([[0, 4], [4, 8]], "gpipe", microbatches=3, global_batch=GLOBAL)


def final_model(results: list[dict]) -> dict:
    """The whole model after the last step, from every stage's parameters (original names)."""
    merged = {}
    for result in results:
        merged.update(result["states"][-1])
    return merged


def test_resume_equals_the_uninterrupted_run(tmp_path):
    whole = final_model(run_ranks(train, 3, THREE, 4, 6, False, None, True))
    first = run_ranks(train, 3, THREE, 2, 6, False, str(tmp_path), True)
    assert len(first[0]["states"]) == 2
    resumed = run_ranks(train, 3, THREE, 4, 6, False, str(tmp_path / ""), True)
    assert len(resumed[0]["states"]) == 2          # steps 3 and 4 only: it continued from step 2
    again = final_model(resumed)
    assert again.keys() == whole.keys()
    assert all(bool((again[k] == whole[k]).all()) for k in whole)   # bit-exact on the same layout


def test_resume_on_another_stage_layout(tmp_path):
    """Three stages save, two stages (a re-plan after losing a device) resume from the same checkpoint."""
    whole = final_model(run_ranks(train, 3, THREE, 4, 6, False, None, True))
    run_ranks(train, 3, THREE, 2, 6, False, str(tmp_path), True)
    resumed = run_ranks(train, 2, TWO, 4, 6, False, str(tmp_path), True)
    assert len(resumed[0]["states"]) == 2
    again = final_model(resumed)
    assert again.keys() == whole.keys()
    worst = max((again[k] - whole[k]).abs().max().item() for k in whole)
    assert worst < 1e-5


def test_resume_fsdp2_stages_on_another_layout(tmp_path):
    """2 replicas x 2 stages sharded with FSDP2 save; 3 unsharded stages resume from the same checkpoint."""
    hybrid = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[8, 4])
    hybrid = hybrid.model_copy(update={"sharding": "fsdp"})
    whole = final_model(run_ranks(train, 3, THREE, 4, 6, False, None, True))
    run_ranks(train, 4, hybrid, 2, 6, False, str(tmp_path), True)
    again = final_model(run_ranks(train, 3, THREE, 4, 6, False, str(tmp_path), True))
    assert again.keys() == whole.keys()
    assert max((again[k] - whole[k]).abs().max().item() for k in whole) < 1e-5


def test_resume_a_hybrid_run_bit_exact(tmp_path):
    """2 replicas x 2 stages: each stage's state is on both replicas, saved once, loaded by both."""
    hybrid = pipeline_plan([[0, 5], [5, 8]], "gpipe", microbatches=2, global_batch=GLOBAL, replica_shares=[4, 8])
    whole = final_model(run_ranks(train, 4, hybrid, 4, 6, False, None, True))
    run_ranks(train, 4, hybrid, 2, 6, False, str(tmp_path), True)
    resumed = run_ranks(train, 4, hybrid, 4, 6, False, str(tmp_path), True)
    assert all(len(r["states"]) == 2 for r in resumed)
    again = final_model(resumed)
    assert all(bool((again[k] == whole[k]).all()) for k in whole)
    for result in resumed:                     # both replicas of each stage hold the same weights
        assert all(bool((v == whole[k]).all()) for k, v in result["states"][-1].items())


def _run_expecting_error(rank, world, plan, directory, direct_call):
    """A run that stops with a HetrainError: a resume across plan kinds, or the script's own model(x)."""
    import torch

    import hetrain
    from hetrain.errors import HetrainError
    from tests.pipeline.common import make_data, make_model

    try:
        session = hetrain.Session(plan, checkpoint_dir=directory, async_checkpoints=False)
        net = make_model(6)
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0)
        if direct_call:
            x, _ = next(iter(loader))
            model(x)
    except HetrainError as e:
        return str(e)
    return None


def test_a_checkpoint_of_another_plan_kind_or_the_scripts_own_forward_is_refused_in_words(tmp_path):
    """A pipeline checkpoint resumed by a data-parallel plan said 'saved with FSDP2 (sharding fsdp)';
    the script's own model(x) on a later stage crashed in its LayerNorm with a shape error."""
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    run_ranks(train, 2, TWO, 2, 6, False, str(tmp_path / "pipe"), False)
    flat = Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=GLOBAL // 2) for r in range(2)])
    messages = run_ranks(_run_expecting_error, 2, flat, str(tmp_path / "pipe"), False)
    assert all("saved by a pipeline plan or with FSDP2" in m and "sharding 'none'" in m for m in messages), messages
    run_ranks(train, 2, flat, 2, 6, False, str(tmp_path / "flat"), False)
    messages = run_ranks(_run_expecting_error, 2, TWO, str(tmp_path / "flat"), False)
    assert all("data-parallel run without FSDP2" in m and "a pipeline plan" in m for m in messages), messages
    messages = run_ranks(_run_expecting_error, 2, TWO, None, True)
    assert all("session.forward_backward" in m for m in messages), messages


def test_a_pipeline_checkpoint_under_fsdp2_and_the_reverse_are_refused_naming_both(tmp_path):
    """Both keep their model in sharded form, under different keys: each names the plan kinds, not a
    missing key of torch's checkpoint reader."""
    import pytest

    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    fsdp = Plan(global_batch_size=GLOBAL, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=6), RankPlan(rank=1, share=6)])
    two = pipeline_plan([[0, 4], [4, 8]], "1f1b", microbatches=3, global_batch=GLOBAL)
    for saved, resumed, words in [(two, fsdp, "saved by a pipeline plan, and this run uses sharding 'fsdp'"),
                                  (fsdp, two, "saved with sharding 'fsdp', and this run uses a pipeline plan")]:
        where = tmp_path / saved.strategy
        run_ranks(train, 2, saved, 2, 6, False, str(where), True)
        with pytest.raises(Exception, match=words):
            run_ranks(train, 2, resumed, 4, 6, False, str(where), True)
