"""Under FSDP2 a rank's non-finite weights are its own shard: every rank stops at the save with a line, the
others naming another rank's, where the others went on into the save and waited there for the rank that stopped."""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks


def _corrupt_then_save(rank, world, directory):
    import hetrain
    from hetrain.errors import HetrainError
    from hetrain.runtime.gradients import local_tensor

    plan = Plan(global_batch_size=8, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=4) for r in range(world)])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    session = hetrain.Session(plan, checkpoint_dir=directory, checkpoint_interval=2, async_checkpoints=False)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    said = []
    try:
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            if session.step_count == 1 and rank == 1:   # a row of rank 1's shard only (as a bad update leaves it)
                with torch.no_grad():
                    local_tensor(next(model.parameters()))[0].fill_(float("nan"))
            session.backward(F.cross_entropy(model(x), y))
            session.step()   # the save of step 2 checks the weights
    except HetrainError as e:
        said.append(str(e))
    try:
        session.close()   # its own save of the last step: refused alike
    except HetrainError as e:
        said.append(str(e))
    return said


def test_a_non_finite_shard_stops_every_rank_at_the_save_in_one_line(tmp_path):
    said = run_ranks(_corrupt_then_save, 2, str(tmp_path), timeout=60)
    assert said[1] and all(line.startswith("parameter 0.weight holds NaN or inf at step 2; no checkpoint is written")
                           for line in said[1]), said
    assert said[0] and all(line.startswith("a parameter of another rank holds NaN or inf at step 2") for line in said[0])
