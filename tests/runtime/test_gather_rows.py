"""`session.gather_rows`: a contrastive loss whose negatives are every rank's samples, on uneven shares. torch's
all_gather needs equal sizes (40 and 24 samples stopped with gloo's 'collective mismatch'); each rank's mean over
its own rows against every rank's columns gives one process's update for any split."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_ranks

GLOBAL, STEPS = 8, 4


class _TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image, self.text = nn.Linear(6, 4), nn.Linear(5, 4)

    def forward(self, images, texts):
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL * STEPS, 6, generator=g), torch.randn(GLOBAL * STEPS, 5, generator=g)


def _clip_loss(images, texts, all_images, all_texts, first):
    """Rows `first:first + len(images)` of the whole batch's symmetric CLIP loss, as their mean."""
    targets = torch.arange(first, first + images.shape[0])
    return (F.cross_entropy(images @ all_texts.T / 0.1, targets) + F.cross_entropy(texts @ all_images.T / 0.1, targets)) / 2


def _job(rank, world, shares, precisions=("fp32", "fp32")):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, precision=p) for r, (s, p) in enumerate(zip(shares, precisions))])
    session = hetrain.Session(plan)
    net = _TwoTowers()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
    for images, texts in session.loader(torch.utils.data.TensorDataset(*_data()), GLOBAL, shuffle=False):
        with session.autocast():
            own_images, own_texts = model(images, texts)
        all_images, first = session.gather_rows(own_images, offset=True)
        all_texts = session.gather_rows(own_texts)
        assert all_images.shape[0] == GLOBAL and first == sum(shares[:rank])
        assert all_images.dtype == own_images.dtype   # a bf16 rank gets its rows back in bf16
        session.backward(_clip_loss(own_images, own_texts, all_images, all_texts, first))
        session.step()
    session.close()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("shares", [(5, 3), (7, 1), (8, 0)])
def test_a_clip_loss_over_every_ranks_samples_is_one_processes_for_any_split(shares):
    """(8, 0): a rank without rows still joins the gather's backward (it hung, its backward made of zeros)."""
    states = run_ranks(_job, 2, shares)
    net = _TwoTowers()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    images, texts = _data()
    for step in range(STEPS):
        batch = slice(step * GLOBAL, (step + 1) * GLOBAL)
        all_images, all_texts = net(images[batch], texts[batch])
        opt.zero_grad()
        _clip_loss(all_images, all_texts, all_images, all_texts, 0).backward()
        opt.step()
    for state in states:
        for name, value in net.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


def test_ranks_in_bf16_and_fp32_gather_one_dtype_and_train_alike():
    """A bf16 rank's rows beside an fp32 rank's: gloo stopped on the size check (40 vs 20 bytes), rank 0 aborted."""
    a, b = run_ranks(_job, 2, (5, 3), ("bf16", "fp32"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _mismatched(rank, world):
    import hetrain
    from hetrain.errors import HetrainError

    session = hetrain.Session()
    try:
        session.gather_rows(torch.zeros(3, 4 if rank == 0 else 5))
    except HetrainError as e:
        return str(e)
    finally:
        session.close()


def test_tensors_of_other_shapes_on_other_ranks_are_refused_on_every_rank():
    for message in run_ranks(_mismatched, 2):
        assert message is not None and "rank 0: rowsx4, rank 1: rowsx5" in message, message


def _on_micro_batches(rank, world):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=6, micro_batch=2), RankPlan(rank=1, share=2)])
    with hetrain.Session(plan) as session:
        net = _TwoTowers()
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
        try:
            for images, texts in session.loader(torch.utils.data.TensorDataset(*_data()), GLOBAL, shuffle=False):
                own_images, own_texts = model(images, texts)
                session.gather_rows(own_images)
        except hetrain.HetrainError as e:
            return str(e)
    return None


def test_a_gather_on_a_micro_batch_is_refused_on_every_rank_naming_the_plan():
    """It joined one piece of each rank's share (4 rows, not 8), and rank 0's second piece met rank 1's next
    collective: gloo's 'collective mismatch', SIGABRT, no word of gather_rows."""
    for message in run_ranks(_on_micro_batches, 2):
        assert message is not None and message.startswith("session.gather_rows() on a micro-batch: rank(s) 0 cut "
                                                          "this step") and "without micro_batch" in message, message
