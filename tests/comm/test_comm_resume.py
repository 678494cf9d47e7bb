"""A resume under a lossy gradient compression says that the error each rank carries starts anew (it is not
checkpointed): the run continues near, not exactly on, an uninterrupted one (docs/checkpoints.md)."""

import torch
import torch.nn.functional as F

from tests.distributed import run_ranks
from tests.runtime.test_refusals import make_data, make_net


def _run(rank, world, directory, steps, compression):
    import hetrain
    from hetrain.planning.plan import BalancePlan, CommPlan, Plan, RankPlan
    from tests.log_lines import hetrain_warnings

    plan = Plan(global_batch_size=8, comm=CommPlan(compression=compression), balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=4) for r in range(world)])
    with hetrain_warnings() as lines, hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=2) as session:
        net = make_net()
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for x, y in session.loader(make_data(), global_batch_size=8, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count >= steps:
                break
    return [line for line in lines if "starts the error each rank carries anew" in line]


def test_a_resume_under_a_lossy_compression_says_its_carried_error_starts_anew(tmp_path):
    assert run_ranks(_run, 2, str(tmp_path / "a"), 2, "int8") == [[], []]
    said = run_ranks(_run, 2, str(tmp_path / "a"), 4, "int8")
    assert len(said[0]) == 1 and "int8 compression" in said[0][0] and said[1] == [], said
    run_ranks(_run, 2, str(tmp_path / "b"), 2, "fp16")   # a compression that carries nothing: nothing to say
    assert run_ranks(_run, 2, str(tmp_path / "b"), 4, "fp16") == [[], []]
