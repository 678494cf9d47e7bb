"""Checkpoint and resume of a Session (DESIGN.md, invariant 5). A rank killed mid-job and restarted by
the launcher, ending on the uninterrupted parameters, is in tests/faults/test_faults.py."""

import torch
import torch.nn.functional as F

from tests.distributed import run_ranks, train_steps


class _Indexed(torch.utils.data.Dataset):
    """The digits with each sample's index, so a test sees which samples each rank was given."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, y, i


def _train(rank, world, ckpt_dir, steps, record_steps):
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    torch.manual_seed(0)
    session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=3, async_checkpoints=False)
    train, _ = digits_datasets()
    net = digits_mlp(hidden=32)
    model, opt = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(_Indexed(train), global_batch_size=60, seed=11)
    start = session.step_count
    seen, losses = [], []
    while session.step_count < steps:
        for x, y, i in loader:
            # the samples this global batch was made of: every rank's slice as the ranks received it
            delivered = session.gather_rows(i)
            if session.step_count - start < record_steps:
                seen.append(delivered.tolist())
            loss = F.cross_entropy(model(x), y)
            session.backward(loss)
            losses.append(session.global_mean(loss))
            session.step()
            if session.step_count >= steps:
                break
    session.close()
    return {"start": start, "seen": seen, "losses": losses, "params": {k: v.clone() for k, v in net.state_dict().items()}}


def test_three_rank_checkpoint_resumed_on_two_ranks_continues_the_same_global_batches(tmp_path):
    first = run_ranks(_train, 3, str(tmp_path / "run"), 9, 0)
    assert first[0]["start"] == 0
    resumed = run_ranks(_train, 2, str(tmp_path / "run"), 14, 5)
    assert resumed[0]["start"] == 9
    # the reference: the samples an uninterrupted run is given at steps 9..13, each once
    from hetrain.bench.digits import digits_datasets
    from hetrain.runtime.data import GlobalBatchOrder

    order = GlobalBatchOrder(len(digits_datasets()[0]), 60, seed=11)
    expected = [order.global_batch(*divmod(step, order.steps_per_epoch)) for step in range(9, 14)]
    assert [sorted(batch) for batch in resumed[0]["seen"]] == [sorted(batch) for batch in expected]
    # and the update: the parameters of a run on three ranks that was never stopped (the sum over the
    # global batch is the same on two ranks, up to float rounding)
    straight = run_ranks(_train, 3, str(tmp_path / "straight"), 14, 0)
    for k, v in straight[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    straight = run_ranks(_train_params, 2, str(tmp_path / "x"), 10, None)
    run_ranks(_train_params, 2, str(tmp_path / "y"), 10, 5)      # stops after step 5 (saved at 3)
    resumed = run_ranks(_train_params, 2, str(tmp_path / "y"), 10, None)
    for k in straight[0]:
        assert torch.equal(straight[0][k], resumed[0][k]), k


def _train_params(rank, world, ckpt_dir, steps, stop_after):
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    torch.manual_seed(0)
    session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=3)
    train, _ = digits_datasets()
    net = digits_mlp(hidden=32)
    model, opt = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    loader = session.loader(train, global_batch_size=64, seed=2)
    def body(batch):
        x, y = batch
        session.backward(F.cross_entropy(model(x + 0.05 * torch.randn_like(x)), y))

    if not train_steps(session, loader, steps, stop_after, body):
        return {}                                   # a crash: no final save
    session.close()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _unfreeze_params(rank, world, ckpt_dir, steps, stop_after):
    """FSDP2: the first layer frozen at prepare() and unfrozen from step 2, as a fine-tuning script does
    (and does again after a resume: its condition reads the restored step count)."""
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    torch.manual_seed(0)
    plan = Plan(global_batch_size=64, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=32) for r in range(world)])
    session = hetrain.Session(plan, checkpoint_dir=ckpt_dir, checkpoint_interval=3)
    train, _ = digits_datasets()
    net = digits_mlp(hidden=32)
    net[0].requires_grad_(False)
    model, opt = session.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    loader = session.loader(train, global_batch_size=64, seed=2)

    def body(batch):
        if session.step_count >= 2:
            net[0].requires_grad_(True)   # the module's parameters are FSDP2's own after prepare()
        x, y = batch
        session.backward(F.cross_entropy(model(x), y))

    if not train_steps(session, loader, steps, stop_after, body):
        return {}
    state = session.model_state_dict()
    session.close()
    return state


def test_a_parameter_unfrozen_mid_run_keeps_its_optimizer_state_through_an_fsdp2_resume(tmp_path):
    """torch's optimizer state dicts leave frozen parameters out: the resume built its template while the
    layer was frozen again, and the layer's AdamW state was dropped (7.25e-05 off after the resume)."""
    straight = run_ranks(_unfreeze_params, 2, str(tmp_path / "x"), 6, None)
    run_ranks(_unfreeze_params, 2, str(tmp_path / "y"), 6, 4)      # stops after step 4 (saved at 3)
    resumed = run_ranks(_unfreeze_params, 2, str(tmp_path / "y"), 6, None)
    for k in straight[0]:
        torch.testing.assert_close(resumed[0][k], straight[0][k], rtol=0, atol=1e-7)
