"""Sharded state in Session checkpoints: ZeRO-1 (even, by memory) and FSDP2 resume exactly, on 2 or 3 ranks."""

import shutil

import pytest
import torch
from torch.utils._pytree import tree_map

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks
from tests.memory.models import make_data, make_model

GiB = 2**30
SHARDINGS = ("zero1", "zero1-proportional", "fsdp")
GLOBAL_BATCH = 8
STEPS, SAVED, CRASH = 8, 3, 5   # checkpoints every 3 steps; the crash after step 5 loses steps 4-5


def _plan(world, sharding):
    shares = Plan.even(world, GLOBAL_BATCH).shares
    capacity = [3 * GiB, 2 * GiB, 1 * GiB][:world]
    return Plan(global_batch_size=GLOBAL_BATCH, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, memory_capacity_bytes=c)
                       for r, (s, c) in enumerate(zip(shares, capacity))])


def _full_state(session, net, model, optimizer):
    """Collective: (full parameters, full optimizer state on rank 0) as CPU copies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if session.sharding == "fsdp":
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(model, optimizer, options=full)
    else:
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        optimizer.consolidate_state_dict(to=0)
        state = optimizer.state_dict() if session.rank == 0 else {}
    return params, tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state)


def _runs(rank, world, runs):
    """Runs one after another in one process group: [(root, steps, crash_after, capture_at)]."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return [_run(*run) for run in runs]


def _run(root, steps, crash_after, capture_at):
    """Each sharding in turn: train to `steps` (resuming), maybe crash; full states."""
    import hetrain

    out = {}
    for sharding in SHARDINGS:
        torch.manual_seed(0)
        session = hetrain.Session(_plan(torch.distributed.get_world_size(), sharding),
                                  checkpoint_dir=f"{root}/{sharding}", checkpoint_interval=SAVED)
        net = make_model()
        model, optimizer = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        loader = session.loader(make_data(), global_batch_size=GLOBAL_BATCH, seed=4)
        result = {"start": session.step_count, "kind": type(optimizer).__name__}
        if capture_at == session.step_count:
            result["captured"] = _full_state(session, net, model, optimizer)
        while session.step_count < steps:
            for x, y in loader:
                x = x + 0.01 * torch.randn_like(x)   # each rank's RNG: restored on resume
                session.backward(torch.nn.functional.cross_entropy(model(x), y))
                session.step()
                if session.step_count == capture_at:
                    result["captured"] = _full_state(session, net, model, optimizer)
                if session.step_count in (steps, crash_after):
                    break
            if session.step_count == crash_after:
                break
        if session.step_count == crash_after:
            session.checkpoints.checkpointer.wait()   # a crash: no final save
        else:
            result["final"] = _full_state(session, net, model, optimizer)[0]
            session.close()
        out[sharding] = result
    return out


def _equal(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """2-rank runs of each sharding: one uninterrupted, one that crashed after step 5 (newest checkpoint: 3)."""
    root = tmp_path_factory.mktemp("runs")
    results = run_ranks(_runs, 2, [(str(root / "straight"), STEPS, None, None),
                                   (str(root / "crashed"), STEPS, CRASH, SAVED)])
    return root / "crashed", [r[0] for r in results], [r[1] for r in results]


def test_zero1_and_fsdp2_resume_on_the_same_ranks_equals_the_uninterrupted_run(crashed, tmp_path):
    root, straight, _ = crashed
    shutil.copytree(root, tmp_path / "resumed")
    resumed = [r[0] for r in run_ranks(_runs, 2, [(str(tmp_path / "resumed"), STEPS, None, None)])]  # a restart
    for sharding in SHARDINGS:
        assert resumed[0][sharding]["start"] == SAVED, sharding
        for rank in range(2):
            _equal(straight[rank][sharding]["final"], resumed[rank][sharding]["final"], sharding)  # bit for bit
    assert straight[0]["zero1-proportional"]["kind"] == "ProportionalZeroRedundancyOptimizer"
    assert straight[0]["fsdp"]["kind"] == "Adam"


def test_zero1_and_fsdp2_state_of_two_ranks_restores_exactly_on_three(crashed, tmp_path):
    root, _, saved = crashed
    shutil.copytree(root, tmp_path / "three")
    restored = [r[0] for r in run_ranks(_runs, 3, [(str(tmp_path / "three"), SAVED, None, SAVED)])]  # no step taken
    for sharding in SHARDINGS:
        assert restored[0][sharding]["start"] == SAVED, sharding
        params, state = saved[0][sharding]["captured"]
        got_params, got_state = restored[0][sharding]["captured"]
        _equal(params, got_params, f"{sharding} params")
        assert state["state"], sharding
        _equal(state["state"], got_state["state"], f"{sharding} optimizer state")
