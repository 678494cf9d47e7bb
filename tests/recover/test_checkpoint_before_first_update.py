"""A checkpoint taken before the first applied update (fp16 warm-up steps that overflow) changes nothing under the
plans whose optimizer state torch's distributed checkpoint saves (pipeline stages, FSDP2). Its state dict gave the
stateless optimizer a step over zero gradients at lr 0: AdamW's step count became 1, the first real update was
bias-corrected as a second, and a 2-stage pipeline ended 0.0128 from the run without checkpoints."""

import pytest
import torch
import torch.nn.functional as F

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks
from tests.pipeline.common import make_data, make_model, pipeline_plan

GLOBAL, STEPS = 12, 8
# the first steps' fp16 gradients overflow at these scales: skipped, the scale halving each time
SCALES = {"pipeline": 2.0 ** 23, "fsdp": 2.0 ** 19}

PLANS = {
    "pipeline": pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=3, global_batch=GLOBAL,
                              precisions=["fp16", "fp32"]),
    "fsdp": Plan(global_batch_size=GLOBAL, sharding="fsdp", balance=BalancePlan(enabled=False),
                 ranks=[RankPlan(rank=r, share=GLOBAL // 2, precision="fp16") for r in range(2)]),
}


def _train(rank, world, plan, directory, stop_at):
    import hetrain

    session = hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=3, async_checkpoints=False,
                              loss_scale={"init_scale": SCALES["pipeline" if plan.pipeline else "fsdp"]})
    net = make_model(6)
    model, _ = session.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0)
    applied = []
    while session.step_count < stop_at:
        for x, y in loader:
            if plan.pipeline is not None:
                session.forward_backward(x, y, F.cross_entropy)
            else:
                with session.autocast():
                    loss = F.cross_entropy(model(x), y)
                session.backward(loss)
            applied.append(session.step())
            if session.step_count == stop_at:
                break
    state = session.model_state_dict()
    session.close()
    return applied, state


@pytest.mark.parametrize("kind", list(PLANS))
def test_a_checkpoint_before_the_first_applied_update_changes_nothing(tmp_path, kind):
    plan = PLANS[kind]
    without = run_ranks(_train, 2, plan, None, STEPS)
    applied = without[0][0]
    assert not any(applied[:3]) and any(applied), applied   # the step-3 checkpoint comes before any update
    with_checkpoints = run_ranks(_train, 2, plan, str(tmp_path / "a"), STEPS)
    assert with_checkpoints[0][0] == applied
    want = without[0][1]
    for got in (with_checkpoints[0][1], *_resumed(plan, tmp_path / "b")):
        assert got.keys() == want.keys()
        assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0


def _resumed(plan, directory):
    run_ranks(_train, 2, plan, str(directory), 3)        # stopped at the step-3 checkpoint, before any update
    return [run_ranks(_train, 2, plan, str(directory), STEPS)[0][1]]


def _ported(rank, world, directory, stop_at):
    """Stage 0 trains nothing (its blocks frozen); the script loads AdamW state of 50 earlier steps (docs/porting.md,
    a run that began without hetrain) before the first steps overflow."""
    import hetrain

    def frozen_net():
        net = make_model(6)
        for block in list(net)[:3]:
            block.requires_grad_(False)
        return net

    earlier = frozen_net()
    trained = [p for p in earlier.parameters() if p.requires_grad]
    before = torch.optim.AdamW(trained, lr=0.01)
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        for p in trained:
            p.grad = torch.randn(p.shape, generator=g)
        before.step()
    plan = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=3, global_batch=GLOBAL, precisions=["fp16", "fp16"])
    session = hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=3, async_checkpoints=False,
                              loss_scale={"init_scale": SCALES["pipeline"]})
    net = frozen_net()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.01)
    optimizer.load_state_dict(before.state_dict())
    model, optimizer = session.prepare(net, optimizer)
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0)
    applied = []
    for x, y in loader:
        session.forward_backward(x, y, F.cross_entropy)
        applied.append(session.step())
        if session.step_count == stop_at:
            break
    counts = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
    state = session.model_state_dict()
    session.close()
    return applied, state, counts


def test_a_ranks_state_loaded_by_the_script_is_kept_though_rank_0s_stage_has_none(tmp_path):
    """Only when no rank's optimizer holds state does a resume empty what it loaded: rank 0's empty optimizer
    (its stage trains nothing) once stood for the job, and the resume emptied rank 1's 50 steps of AdamW state."""
    without = run_ranks(_ported, 2, None, STEPS)
    assert not any(without[0][0][:3]) and any(without[0][0]) and without[1][2] == [52.0]
    run_ranks(_ported, 2, str(tmp_path), 3)
    resumed = run_ranks(_ported, 2, str(tmp_path), STEPS)
    assert resumed[1][2] == [52.0]
    want, got = without[0][1], resumed[0][1]
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
