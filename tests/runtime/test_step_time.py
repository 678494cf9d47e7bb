"""Where a step's wall time goes: the script's own time between steps is not a wait on other ranks."""

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def test_time_the_script_spends_after_step_is_its_own_not_a_wait_on_ranks():
    import hetrain

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    records = []
    with hetrain.Session() as session:
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=records.append))
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            time.sleep(0.05)                       # the script's own work: logging, evaluation
    timed = [r for r in records if r.step_seconds is not None]
    assert len(timed) == 7
    for r in timed:
        assert r.script_seconds == pytest.approx(0.05, abs=0.03)
        assert r.waiting_seconds < 0.02            # one rank waits on no one
        parts = r.compute_seconds + r.data_wait_seconds + r.script_seconds + r.waiting_seconds
        assert parts == pytest.approx(r.step_seconds, abs=1e-9)


@pytest.mark.parametrize("speed", [None, "0.5"])
def test_the_loop_bodys_time_between_micro_batches_is_the_scripts_never_compute(monkeypatch, speed):
    """Under micro-batches the loop body runs once per piece; its own time between them was counted as
    compute (84% of a step that spent 76% sleeping) and, at an emulated speed, padded as compute too."""
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan
    from hetrain.vocabulary import Env

    if speed:
        monkeypatch.setenv(Env.EMULATE_SPEEDS, speed)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8, micro_batch=2)])
    records = []
    with hetrain.Session(plan) as session:
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=records.append))
        for x, y in session.loader(data, global_batch_size=8, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            if not session.step():
                time.sleep(0.1)   # the loop body's own work, after each of the step's first three pieces
            if session.step_count == 5:
                break
    timed = [r for r in records if r.step_seconds is not None]
    assert len(timed) == 4
    for r in timed:
        assert r.script_seconds == pytest.approx(0.3, abs=0.06), r
        # four pieces of a 6-8-3 network, padded at half speed or not; before, the 0.3 s of sleep too (padded: 0.6 s)
        assert r.compute_seconds < 0.3 / float(speed or 1), r
        parts = r.compute_seconds + r.data_wait_seconds + r.script_seconds + r.waiting_seconds
        assert parts == pytest.approx(r.step_seconds, abs=1e-9)


def _checkpointed_run(tmp_path, *, async_checkpoints, num_items=None, steps=6):
    """Steps of a session whose model holds a large frozen buffer (so a save takes a while), a
    checkpoint every 2 steps; returns (step records, checkpoint records)."""
    import hetrain

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    steps_seen, saves = [], []
    with hetrain.Session(checkpoint_dir=str(tmp_path), checkpoint_interval=2,
                         async_checkpoints=async_checkpoints) as session:
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        net.register_buffer("frozen", torch.randn(8_000_000))   # 32 MB in every checkpoint
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=steps_seen.append, on_checkpoint=saves.append))
        for i, (x, y) in enumerate(session.loader(data, global_batch_size=8, shuffle=False)):
            loss = F.cross_entropy(model(x), y)
            with torch.no_grad():
                model(x)                              # an evaluation: not the step's work
            session.backward(loss, num_items=None if num_items is None else num_items[i % len(num_items)])
            session.step()
            if session.step_count == steps:
                break
    return steps_seen, saves


def test_a_checkpoint_save_holding_the_loop_is_its_own_part_not_a_wait_on_ranks(tmp_path):
    records, saves = _checkpointed_run(tmp_path, async_checkpoints=False)
    after_save = [r for r in records if r.step_seconds is not None and (r.step - 1) % 2 == 0 and r.step > 1]
    assert after_save and all(r.checkpoint_seconds > 0.005 for r in after_save)
    held = {s.step: s.blocking_seconds for s in saves}
    for r in after_save:
        assert r.checkpoint_seconds == pytest.approx(held[r.step - 1], rel=0.5, abs=0.01)
        assert r.waiting_seconds < 0.5 * r.checkpoint_seconds   # one rank waits on no one
        parts = (r.compute_seconds + r.data_wait_seconds + r.script_seconds + r.checkpoint_seconds
                 + r.waiting_seconds)
        assert parts == pytest.approx(r.step_seconds, abs=1e-9)


def test_a_background_checkpoint_reports_its_own_size_and_save_time(tmp_path):
    from hetrain.checkpoint.checkpointer import Checkpointer

    _, saves = _checkpointed_run(tmp_path, async_checkpoints=True)
    assert [s.step for s in saves] == [2, 4, 6]
    for s in saves:
        on_disk = sum(f.stat().st_size for f in (tmp_path / f"step-{s.step:06d}").rglob("*")
                      if f.is_file() and f.name != "manifest.json")
        assert s.bytes == on_disk and s.bytes > 30e6, (s, on_disk)
        assert s.total_seconds >= s.blocking_seconds and s.total_seconds > 0
    assert Checkpointer(tmp_path).latest().step == 6


def test_mfu_counts_the_flops_of_each_batch_not_its_item_count(tmp_path):
    """The same batch shape with different token counts (num_items) is the same work for the model;
    a forward under no_grad (an evaluation) is not the step's."""
    records, _ = _checkpointed_run(tmp_path, async_checkpoints=True, num_items=[8, 3, 5])
    flops = [r.model_flops for r in records]
    assert all(f is not None for f in flops), flops
    expected = 3 * 2 * 8 * (6 * 8 + 8 * 3)   # forward and backward of two Linear layers on 8 samples
    assert flops == [pytest.approx(expected)] * len(flops)


def _fsdp2_pieces(rank, world):
    import torch.distributed as dist

    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    dist.init_process_group("gloo")
    plan = Plan(global_batch_size=32, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=16, micro_batch=2) for r in range(2)])
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 64, generator=g), torch.randint(0, 8, (256,), generator=g))
    records = []
    with hetrain.Session(plan) as session:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                  torch.nn.Linear(512, 8))
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.add_observer(SimpleNamespace(on_step=records.append))
        for x, y in session.loader(data, global_batch_size=32, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))   # nothing of the script's own between the pieces
            session.step()
            if session.step_count == 6:
                break
    return [(r.script_seconds, r.waiting_seconds) for r in records if r.step_seconds is not None]


def test_fsdp2s_all_gathers_between_micro_batches_are_waits_not_the_scripts_time():
    """The fast rank's wait in a later piece's all-gather for the slow rank was taken for the script's time."""
    from tests.distributed import run_ranks

    fast, slow = run_ranks(_fsdp2_pieces, 2, env={"HETRAIN_EMULATE_SPEEDS": "1,0.25"})
    for script, _ in fast + slow:
        assert script < 0.01, (fast, slow)
    assert sum(wait for _, wait in fast) > sum(wait for _, wait in slow), (fast, slow)
