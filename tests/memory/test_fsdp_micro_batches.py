"""ZeRO-3 (FSDP2) with micro-batches: every rank runs the job's count of them, holding only its shards
between them, and the update is the single process's."""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks

GLOBAL, STEPS, LR = 8, 3, 0.1


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(GLOBAL * STEPS, 6, generator=g), torch.randint(0, 3, (GLOBAL * STEPS,), generator=g))


def _train(rank, world):
    import hetrain
    from torch.distributed.tensor import DTensor

    # rank 0: 6 samples in micro-batches of 2 (3 of them); rank 1: 2 samples, no cap (1 of its own)
    plan = Plan(global_batch_size=GLOBAL, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=6, micro_batch=2), RankPlan(rank=1, share=2)])
    session = hetrain.Session(plan)
    net = make_net()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=False)
    pieces, sharded_between = 0, []
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y))
        pieces += 1
        if not session.step():
            sharded_between.append(all(isinstance(p, DTensor) for p in net.parameters()))
        if session.step_count == STEPS:
            break
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    session.close()
    return {"pieces": pieces, "sharded_between": sharded_between, "params": params}


def test_every_rank_runs_the_jobs_micro_batches_holding_only_its_shards_between_them():
    results = run_ranks(_train, 2)
    net, data = make_net(), make_data()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data[step * GLOBAL:(step + 1) * GLOBAL]
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    for r in results:
        assert r["pieces"] == 3 * STEPS                          # the same collectives on both ranks
        assert r["sharded_between"] and all(r["sharded_between"])  # parameters resharded after each piece
        assert max((a - b).abs().max().item() for a, b in zip(r["params"], net.parameters())) < 1e-6


def test_the_layers_of_a_sequential_with_embedding_and_head_are_its_blocks():
    """A model built as a pipeline script builds it, nn.Sequential(embedding, *layers, head), had no
    blocks found: a data-parallel plan's activation checkpointing recomputed nothing."""
    from hetrain.bench.tiny_lm import tiny_gpt2
    from hetrain.runtime.memory import find_blocks
    from hetrain.runtime.pipeline_models import GPT2Layer, gpt2_blocks

    blocks = find_blocks(gpt2_blocks(tiny_gpt2(layers=3)))
    assert len(blocks) == 3 and all(isinstance(b, GPT2Layer) for b in blocks)
    assert find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2))) == []


def _batchnorm_train(rank, world):
    import hetrain

    # rank 0: 6 samples in micro-batches of 2 (3 pieces); rank 1: its 2 samples, then 2 stand-ins
    plan = Plan(global_batch_size=GLOBAL, sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=6, micro_batch=2), RankPlan(rank=1, share=2, micro_batch=2)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    sizes, counted = [], []
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=False)
    for x, y in loader:
        sizes.append(len(x))
        counted.append(loader.piece_samples)   # what a loop counting samples or accuracy adds up
        session.backward(F.cross_entropy(model(x), y))
        session.step()
    session.close()
    return sizes, counted


def test_a_rank_short_of_pieces_keeps_its_own_micro_batches_which_batchnorm_trains_on():
    """Its 2 samples were spread over the job's 3 pieces as 1, 1 and a stand-in: BatchNorm stopped with
    'Expected more than 1 value per channel when training', though no plan gave a micro-batch of 1."""
    (zero, zero_counted), (one, one_counted) = run_ranks(_batchnorm_train, 2)
    assert zero == [2, 2, 2] * STEPS and one == [2, 2, 2] * STEPS   # rank 1: its 2, then two stand-ins of 2
    # the loop tells a stand-in from its own samples: loader.piece_samples counts only these
    assert zero_counted == [2, 2, 2] * STEPS and one_counted == [2, 0, 0] * STEPS
