"""The step's figures (items, loss, flags) ride in a small gradient bucket's all-reduce, or in one of their own:
the bucket that takes them is copied, and the last bucket (up to 25 MiB; on CPU ranks, all the gradients)
was copied twice a step."""

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_ranks


def _net(width):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(60, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(48, 60, generator=g), torch.randint(0, 3, (48,), generator=g)


def _train(rank, world, width):
    import hetrain
    from hetrain.runtime import timing

    carried = []
    plain = timing._allreduce_with_figures

    def recording(bucket, figures):
        carried.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return plain(bucket, figures)

    timing._allreduce_with_figures = recording
    with hetrain.Session(balance=False) as session:
        net = _net(width)
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        losses = []
        for x, y in session.loader(torch.utils.data.TensorDataset(*_data()), global_batch_size=16, shuffle=False):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            losses.append(session.loss)
    return carried, losses, {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("width, riding", [(64, 2), (8000, 0)])
def test_the_step_figures_ride_only_in_a_small_bucket_and_the_update_stays_exact(width, riding):
    """A 16 KB model's one bucket carries them from the second step (the first tells the sizes); a 2 MB
    model's (a CPU job's DDP keeps one bucket) is not copied: they go in an all-reduce of their own."""
    (carried, losses, state), _ = run_ranks(_train, 2, width)
    assert len(carried) == riding and all(size <= 1 << 20 for size in carried), carried
    net = _net(width)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x_all, y_all = _data()
    for i, start in enumerate(range(0, 48, 16)):
        loss = F.cross_entropy(net(x_all[start:start + 16]), y_all[start:start + 16])
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(losses[i] - loss.item()) < 1e-6
    for name, value in net.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
