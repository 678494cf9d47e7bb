"""The loader inside a Session on 2 CPU ranks: streams at shares 3:1, workers, resume, scheduled re-splits."""

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

from tests.distributed import run_ranks

GLOBAL = 8


class DigitStream(IterableDataset):
    """The digits in a fixed shuffled order, as a stream; each sample carries its index."""

    def __iter__(self):
        from hetrain.bench.digits import digits_datasets

        x, y = digits_datasets()[0].tensors
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(3))
        for i in order.tolist():
            yield x[i], y[i], i

    @staticmethod
    def order():
        from hetrain.bench.digits import digits_datasets

        n = len(digits_datasets()[0])
        return torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()


def _train_stream(rank, world, ckpt_dir, steps, stop_after, workers):
    import hetrain
    from hetrain.bench.digits import digits_mlp
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    torch.manual_seed(0)
    plan = Plan(global_batch_size=GLOBAL, ranks=[RankPlan(rank=0, share=6), RankPlan(rank=1, share=2)],
                balance=BalancePlan(enabled=False))
    session = hetrain.Session(plan, checkpoint_dir=ckpt_dir, checkpoint_interval=3, async_checkpoints=False)
    net = digits_mlp(hidden=16)
    model, opt = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    loader = session.loader(DigitStream(), global_batch_size=GLOBAL, num_workers=workers)
    start, seen = session.step_count, []
    while session.step_count < steps:
        for x, y, index in loader:
            seen.append(index.tolist())
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if stop_after is not None and session.step_count == stop_after:
                return {}                                   # a crash: no final save
            if session.step_count >= steps:
                break
    session.close()
    return {"start": start, "seen": seen, "params": {k: v.clone() for k, v in net.state_dict().items()}}


def test_a_stream_trains_on_two_ranks_at_shares_3_to_1_and_resumes_exactly(tmp_path):
    straight = run_ranks(_train_stream, 2, str(tmp_path / "x"), 8, None, 2)
    order = DigitStream.order()
    for step, (a, b) in enumerate(zip(straight[0]["seen"], straight[1]["seen"])):
        assert len(a) == 6 and len(b) == 2                  # each rank its share of every global batch
        assert a + b == order[GLOBAL * step: GLOBAL * (step + 1)]   # in stream order, each sample once
    run_ranks(_train_stream, 2, str(tmp_path / "y"), 8, 5, 2)      # stops after step 5 (saved at 3)
    resumed = run_ranks(_train_stream, 2, str(tmp_path / "y"), 8, None, 2)
    assert resumed[0]["start"] == 3 and resumed[0]["seen"] == straight[0]["seen"][3:]
    for k, v in straight[0]["params"].items():
        assert torch.equal(v, resumed[0]["params"][k]), k


def _train_map(rank, world, ckpt_dir, steps, stop_after):
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    torch.manual_seed(0)
    session = hetrain.Session(balance=False, checkpoint_dir=ckpt_dir, checkpoint_interval=3, async_checkpoints=False)
    train, _ = digits_datasets()
    net = digits_mlp(hidden=16)
    model, opt = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    loader = session.loader(train, global_batch_size=64, seed=2, num_workers=2, prefetch_factor=2)
    while session.step_count < steps:
        for x, y in loader:
            x = x + 0.05 * torch.randn_like(x)              # the training process's RNG, restored on resume
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if stop_after is not None and session.step_count == stop_after:
                return {}
            if session.step_count >= steps:
                break
    session.close()
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_resume_mid_epoch_with_workers_equals_the_uninterrupted_run(tmp_path):
    straight = run_ranks(_train_map, 2, str(tmp_path / "x"), 8, None)
    run_ranks(_train_map, 2, str(tmp_path / "y"), 8, 5)
    resumed = run_ranks(_train_map, 2, str(tmp_path / "y"), 8, None)
    for k in straight[0]:
        assert torch.equal(straight[0][k], resumed[0][k]), k


def _balanced(rank, world):
    import hetrain
    from hetrain.bench.digits import digits_datasets, digits_mlp

    session = hetrain.Session(balance=True, balance_interval=2)
    train, _ = digits_datasets()
    net = digits_mlp()   # enough compute per step that its 4x stands out of a loaded machine's noise
    model, opt = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = session.loader(train, global_batch_size=64, num_workers=1, prefetch_factor=2)
    sizes = []
    while session.step_count < 30:
        for x, y in loader:
            sizes.append(len(x))
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count >= 30:
                break
    changes = [(c.step, c.old, c.new) for c in session.balancer.changes]
    session.close()
    return {"sizes": sizes, "changes": changes, "lag": loader.lag}


def test_a_resplit_reaches_every_rank_at_the_same_later_step():
    """Rank 1 at a quarter speed: the balancer moves samples to rank 0; each change decided after
    step t is used from step t + lag on both ranks, where lag is the prefetch depth (1 worker x 2)."""
    ranks = run_ranks(_balanced, 2, env={"HETRAIN_EMULATE_SPEEDS": "1,0.25"})
    assert ranks[0]["lag"] == 2 and ranks[0]["changes"] == ranks[1]["changes"] and ranks[0]["changes"]
    for rank, r in enumerate(ranks):
        for t, old, new in r["changes"]:
            if t + r["lag"] < len(r["sizes"]):
                assert r["sizes"][t + r["lag"] - 1] == old[rank] and r["sizes"][t + r["lag"]] == new[rank]
    assert all(a + b == 64 for a, b in zip(ranks[0]["sizes"], ranks[1]["sizes"]))


def _loader_settings(rank, world, key):
    import hetrain
    from hetrain.errors import HetrainError

    settings = {"seed": 0, "global_batch_size": 16, "samples": 64}
    settings[key] = settings[key] + rank      # one node's script differs
    with hetrain.Session(balance=False) as session:
        net = torch.nn.Linear(4, 2)
        session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        data = torch.utils.data.TensorDataset(torch.randn(settings["samples"], 4))
        try:
            session.loader(data, global_batch_size=settings["global_batch_size"], seed=settings["seed"])
        except HetrainError as e:
            return str(e)
        return None


def test_ranks_whose_loader_settings_differ_are_refused_naming_the_setting():
    """One node with seed=1 lost 63 of 256 samples an epoch and read 63 twice, exit 0."""
    for key, named in (("seed", "seed: rank 0 0, rank 1 1"), ("global_batch_size", "global_batch_size: rank 0 16"),
                       ("samples", "samples: rank 0 64, rank 1 65")):
        errors = run_ranks(_loader_settings, 2, key)
        assert all(e is not None and named in e and "same dataset" in e for e in errors), errors


def _last_batch_warning(rank, world, samples):
    import hetrain
    from tests.log_lines import hetrain_warnings

    with hetrain.Session() as session, hetrain_warnings() as lines:
        net = torch.nn.Linear(2, 1)
        session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        session.loader(torch.utils.data.TensorDataset(torch.randn(samples, 2)), global_batch_size=8, drop_last=False)
    return [line for line in lines if "get an empty batch" in line]


def test_a_last_batch_smaller_than_the_ranks_is_said_with_a_fix_that_works():
    """With fewer samples than one global batch, drop_last=True (the fix it named) is refused: the dataset
    is that batch."""
    said = run_ranks(_last_batch_warning, 2, 9)[0]
    assert len(said) == 1 and said[0].endswith("drop_last=True avoids it"), said
    said = run_ranks(_last_batch_warning, 2, 1)[0]
    assert len(said) == 1 and said[0].endswith("the dataset is that batch, so only more samples avoid it"), said
