"""A checkpoint's split resumed under a plan whose min_share or max_share it breaks starts from the new plan's
split. Continued as saved, a rank at 0 samples stayed there under a plan giving every rank one (a model that
cannot take an empty batch failed every restart) and a rank kept 24 samples under a max_share of 16."""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.balance_config import saved_split_outside
from tests.distributed import run_ranks
from tests.log_lines import hetrain_warnings

GLOBAL = 8


def _plan(shares, **balance) -> Plan:
    return Plan(global_batch_size=GLOBAL, balance=BalancePlan(interval=100, **balance),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(shares)])


def _run(rank, world, directory, plan, steps):
    import hetrain

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    with hetrain_warnings() as lines:
        session = hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=2, async_checkpoints=False)
        net = torch.nn.Linear(4, 2)
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        loader = session.loader(data, global_batch_size=GLOBAL, shuffle=True, seed=0)
        taken = []
        for x, y in loader:
            taken.append(len(x))
            session.backward(F.cross_entropy(model(x), y) if len(x) else model(x).sum() * 0)
            session.step()
            if session.step_count == steps:
                break
        session.close()
    return taken, [line for line in lines if "resuming where" in line]


def test_a_split_outside_the_new_bounds_is_named():
    assert saved_split_outside([8, 0], BalancePlan(min_share=1)) == (
        "rank 1 was at 0 samples, below this run's balance.min_share 1")
    assert saved_split_outside([6, 2], BalancePlan(min_share=1, max_share=5)) == (
        "rank 0 was at 6 samples, above this run's balance.max_share 5")
    assert saved_split_outside([6, 2], BalancePlan(min_share=2, max_share=6)) is None


def test_a_resume_under_a_plan_whose_bounds_the_saved_split_breaks_starts_from_the_new_plans_split(tmp_path):
    first = run_ranks(_run, 2, str(tmp_path / "a"), _plan([8, 0], min_share=0), 2)
    assert [t for t, _ in first] == [[8, 8], [0, 0]]
    resumed = run_ranks(_run, 2, str(tmp_path / "a"), _plan([4, 4], min_share=1), 4)
    assert [t for t, _ in resumed] == [[4, 4], [4, 4]]
    assert resumed[0][1] == ["resuming where rank 1 was at 0 samples, below this run's balance.min_share 1: the split "
                             "starts from this run's plan and is measured anew"] and resumed[1][1] == []
    run_ranks(_run, 2, str(tmp_path / "b"), _plan([8, 0], min_share=0), 2)
    capped = run_ranks(_run, 2, str(tmp_path / "b"), _plan([5, 3], min_share=0, max_share=6), 4)
    assert [t for t, _ in capped] == [[5, 5], [3, 3]]
    # within the new bounds the saved split goes on, as before
    run_ranks(_run, 2, str(tmp_path / "c"), _plan([6, 2], min_share=0), 2)
    kept = run_ranks(_run, 2, str(tmp_path / "c"), _plan([4, 4], min_share=1, max_share=7), 4)
    assert [t for t, _ in kept] == [[6, 6], [2, 2]] and kept[0][1] == []
    # a plan whose own split is outside its bounds (balancing off does not check them) resumes as it ran
    own = _plan([6, 2], min_share=0, max_share=5, enabled=False)
    run_ranks(_run, 2, str(tmp_path / "d"), own, 2)
    again = run_ranks(_run, 2, str(tmp_path / "d"), own, 4)
    assert [t for t, _ in again] == [[6, 6], [2, 2]] and again[0][1] == []
