"""A model's buffers across ranks (hetrain.runtime.buffers): after every step each rank holds rank 0's, so an
EMA of the model, a validation loss and a checkpoint under any sharding agree with the model that is saved;
a forward without samples leaves them alone."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.distributed import run_ranks

SHARES, GLOBAL = (5, 3), 8


class _RunningMean(nn.Module):
    """BatchNorm's running statistics beside a buffer of the model's own, which the forward reads."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        if self.training:
            with torch.no_grad():   # a running mean of the inputs: over no rows, NaN
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.out(self.bn(self.fc(x - self.mean)))


def _data(n):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g))


def _job(rank, world, sharding, ckpt_dir):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(SHARES)])
    session = hetrain.Session(plan, checkpoint_dir=ckpt_dir, checkpoint_interval=2)
    torch.manual_seed(0)
    net = _RunningMean()
    model, opt = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    if sharding != "fsdp":   # the EMA recipe of docs/checkpoints.md (FSDP2's modules cannot be deep-copied):
        # AveragedModel copies the model's buffers at each update
        ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        opt.register_step_post_hook(lambda *_: ema.update_parameters(net))
        session.add_state("ema", ema)
    loader = session.loader(_data(48), GLOBAL, shuffle=False)
    after_steps = []
    for x, y in loader:
        session.backward(F.mse_loss(model(x), y))
        session.step()
        after_steps.append({k: v.clone() for k, v in net.named_buffers()})
    final = session.model_state_dict()
    session.close()
    return after_steps, final


def _reference():
    """One process: each step's gradient is the share-weighted mean of the ranks' (each normalises over its own
    slice), and the buffers move as rank 0's forward moves them, from the buffers of the step before."""
    torch.manual_seed(0)
    net = _RunningMean()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x_all, y_all = _data(48).tensors
    after_steps = []
    for start in range(0, 48, GLOBAL):
        x, y = x_all[start:start + GLOBAL], y_all[start:start + GLOBAL]
        before = {k: v.clone() for k, v in net.named_buffers()}
        late = F.mse_loss(net(x[SHARES[0]:]), y[SHARES[0]:]) * SHARES[1] / GLOBAL
        for k, v in net.named_buffers():
            v.data.copy_(before[k])   # past autograd's version check: BatchNorm's backward is given them
        loss = F.mse_loss(net(x[:SHARES[0]]), y[:SHARES[0]]) * SHARES[0] / GLOBAL + late
        loss.backward()
        opt.step()
        opt.zero_grad()
        after_steps.append({k: v.clone() for k, v in net.named_buffers()})
    return after_steps, net.state_dict()


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_every_rank_holds_rank_0s_buffers_after_each_step(tmp_path, sharding):
    """Each rank's forward moves BatchNorm's statistics (and the model's own buffers) with its own share:
    between steps the ranks held different models, so the docs' EMA recipe (AveragedModel copies buffers) was
    refused at the first checkpoint as state that differs between ranks, and FSDP2 kept each rank's own
    buffers (a checkpoint held one arbitrary rank's)."""
    ranks = run_ranks(_job, 2, sharding, str(tmp_path / "ckpt"))
    ref_steps, ref_final = _reference()
    assert len(ranks[0][0]) == len(ref_steps) == 6
    for step, (zero, one, ref) in enumerate(zip(ranks[0][0], ranks[1][0], ref_steps)):
        for name in ref:
            assert torch.equal(zero[name], one[name]), (step, name)
            torch.testing.assert_close(zero[name], ref[name], rtol=0, atol=1e-6, msg=f"{step} {name}")
    for name, value in ref_final.items():
        torch.testing.assert_close(ranks[0][1][name], value, rtol=0, atol=1e-6, msg=name)


def _empty_job(rank, world):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=GLOBAL, sharding="none", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=3), RankPlan(rank=1, share=5)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    net.register_buffer("seen", torch.zeros(()))
    net.register_forward_pre_hook(lambda m, args: m.seen.add_(args[0].shape[0]) and None)   # the rows it saw
    holder = _RunningMean()
    holder.fc, holder.bn, holder.out = nn.Identity(), nn.Identity(), net
    model, opt = session.prepare(holder, torch.optim.SGD(holder.parameters(), lr=0.1))
    loader = session.loader(_data(41), GLOBAL, shuffle=False, drop_last=False)
    applied, sizes = [], []
    for x, y in loader:
        sizes.append(len(x))
        session.backward(F.mse_loss(model(x), y))
        applied.append(session.step())
    state = {k: v.clone() for k, v in holder.named_buffers()}
    session.close()
    return applied, sizes, state


def test_a_forward_without_samples_leaves_the_buffers_alone():
    """The epoch's last global batch (1 sample) leaves one rank none: its running mean over no rows was NaN,
    copied to every rank, and every later step was skipped for non-finite values."""
    ranks = run_ranks(_empty_job, 2)
    (applied, sizes, state), (_, other_sizes, other) = ranks
    assert sorted([sizes[-1], other_sizes[-1]]) == [0, 1]
    assert all(applied)
    for name, value in state.items():
        assert torch.isfinite(value).all() and torch.equal(value, other[name]), name
    # rank 0's rows of each full step, then the last step's one row: the buffers of the rank that had it
    assert state["out.seen"].item() == (41 - 1) * 3 / GLOBAL + 1


def _first_rank_empty_job(rank, world):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=GLOBAL, sharding="none", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=0), RankPlan(rank=1, share=GLOBAL)])
    with hetrain.Session(plan) as session:
        torch.manual_seed(0)
        net = _RunningMean()
        model, opt = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for x, y in session.loader(_data(32), GLOBAL, shuffle=False):
            session.backward(F.mse_loss(model(x), y))
            session.step()
        return {k: v.clone() for k, v in net.state_dict().items()}


def test_a_step_where_rank_0_has_no_samples_keeps_the_statistics_of_the_rank_that_had_them():
    """Every rank took rank 0's buffers after each step: with rank 0's share 0 (a plan, or the balancer's
    min_share 0 with rank 0 the slow one) BatchNorm's running statistics never moved (0.18 off one process
    after 4 steps, num_batches_tracked 0), so evaluation, checkpoints and model_state_dict() were wrong."""
    ranks = run_ranks(_first_rank_empty_job, 2)
    torch.manual_seed(0)
    net = _RunningMean()   # one process, on the global batch (all of it rank 1's)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x_all, y_all = _data(32).tensors
    for start in range(0, 32, GLOBAL):
        F.mse_loss(net(x_all[start:start + GLOBAL]), y_all[start:start + GLOBAL]).backward()
        opt.step()
        opt.zero_grad()
    assert net.bn.num_batches_tracked.item() == 4
    for name, value in net.state_dict().items():
        for state in ranks:
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


class _GrowingCache(nn.Module):
    """A buffer the forward replaces with one sized by its rank's batch (a positional cache grown to the
    longest sequence it has seen, as rotary caches are)."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(20, 8), nn.Linear(8, 3)
        self.register_buffer("pos", torch.arange(4).float(), persistent=False)

    def forward(self, x):
        if x.shape[1] > self.pos.shape[0]:
            self.pos = torch.arange(x.shape[1]).float() / 10
        return self.out((self.emb(x) * self.pos[:x.shape[1], None]).mean(1))


def _pad(items):
    longest = max(len(s) for s, _ in items)
    return torch.stack([F.pad(s, (0, longest - len(s))) for s, _ in items]), torch.stack([y for _, y in items])


def _growing_job(rank, world, sharding):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(1, 20, (3 if i % 8 < 5 else 6,), generator=g), torch.randint(0, 3, (), generator=g))
            for i in range(32)]   # rank 0's sequences are 3 long, rank 1's 6
    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(SHARES)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = _GrowingCache()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, GLOBAL, shuffle=False, collate_fn=_pad):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
    session.close()
    return net.pos.clone()


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_buffer_a_forward_replaces_with_one_of_its_own_size_stays_the_ranks_own(sharding):
    """Rank 1's cache (6 long) received rank 0's (4 long) over its start: [0, .1, .2, .3, .4, .5] became
    [0, 1, 2, 3, .4, .5], which its next forwards read."""
    zero, one = run_ranks(_growing_job, 2, sharding)
    assert torch.equal(zero, torch.arange(4).float())
    assert torch.equal(one, torch.arange(6).float() / 10)


def _lazy_job(rank, world):
    import hetrain

    session = hetrain.Session()
    net = nn.Sequential(nn.Linear(4, 8), nn.LazyBatchNorm1d())
    try:
        session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    except Exception as e:   # torch's message, which names the fix
        return str(e)
    finally:
        session.close()


def test_a_lazy_module_gets_a_message_naming_a_first_forward_not_an_error_from_copying_its_buffers():
    """The buffer copy ran before DDP and failed on the uninitialized buffer ('uninitialized parameter in
    numel'); prepare() now names the first forward before anything is copied."""
    for message in run_ranks(_lazy_job, 2):
        assert message is not None and "run one forward on a sample batch before session.prepare()" in message, \
            message


class _OutOfPlace(nn.Module):
    """A running mean kept as `self.m = 0.9 * self.m + ...`: a new tensor in the buffer's place every forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("m", torch.zeros(4))

    def forward(self, x):
        if self.training:
            self.m = 0.9 * self.m + 0.1 * x.mean(0).detach()
        return self.fc(x - self.m)


def _out_of_place_job(rank, world, sharding):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(SHARES)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = _OutOfPlace()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(_data(48), GLOBAL, shuffle=False):
        session.backward(F.mse_loss(model(x), y))
        session.step()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in net.state_dict().items()}
    session.close()
    return net.m.clone(), state


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_buffer_replaced_by_each_forward_is_rank_0s_on_every_rank(sharding):
    """The copy took the tensors the model held at prepare(), which such a forward replaces: each rank kept its
    own running mean (0.10 apart), and the parameters moved 4.3e-03 off."""
    (m0, s0), (m1, s1) = run_ranks(_out_of_place_job, 2, sharding)
    assert torch.equal(m0, m1)
    torch.manual_seed(0)
    net = _OutOfPlace()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x_all, y_all = _data(48).tensors
    for start in range(0, 48, GLOBAL):
        x, y = x_all[start:start + GLOBAL], y_all[start:start + GLOBAL]
        before = net.m
        late = F.mse_loss(net(x[SHARES[0]:]), y[SHARES[0]:]) * SHARES[1] / GLOBAL
        net.m = before
        loss = F.mse_loss(net(x[:SHARES[0]]), y[:SHARES[0]]) * SHARES[0] / GLOBAL + late   # rank 0's buffer stays
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(m0, net.m, rtol=0, atol=1e-6)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(s0[name], value, rtol=0, atol=1e-6, msg=name)
