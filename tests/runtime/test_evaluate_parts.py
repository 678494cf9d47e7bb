"""session.evaluate with a rank whose part of the evaluation set is empty (a set smaller than the ranks, or
split unevenly): that rank counts nothing; under FSDP2, whose forward is collective, every rank refuses."""

import torch
from torch.utils.data import default_collate

from hetrain.bench.tiny_lm import PaddedTokens, predicted_tokens, tiny_gpt2
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks

EVAL = 6


def _lm_loss(out, labels):
    return out.loss


def _evaluate_with_an_empty_part(rank, world, sharding):
    import hetrain
    from hetrain.errors import HetrainError

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=4) for r in range(world)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = tiny_gpt2(context=16)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = PaddedTokens(n=EVAL, length=12, seed=3)
    rows = range(EVAL) if rank == 0 else range(0)          # rank 1 has nothing to evaluate
    batch = default_collate([data[i] for i in rows]) if rows else {k: v[:0] for k, v in
                                                                    default_collate([data[0]]).items()}
    labels = batch.pop("labels")
    try:
        loss = session.evaluate(dict(batch, labels=labels), labels, _lm_loss, num_items=predicted_tokens)
    except HetrainError as e:
        loss = str(e)
    session.close()
    return loss


def test_a_rank_with_an_empty_part_counts_nothing_and_the_loss_is_the_other_parts():
    """Its forward crashed inside GPT-2 (cannot reshape a tensor of 0 elements), with no hint."""
    torch.manual_seed(0)
    net, data = tiny_gpt2(context=16), PaddedTokens(n=EVAL, length=12, seed=3)
    with torch.no_grad():
        want = net(**default_collate([data[i] for i in range(EVAL)])).loss.item()
    for loss in run_ranks(_evaluate_with_an_empty_part, 2, "none"):
        assert abs(loss - want) < 1e-5, (loss, want)


def test_under_fsdp2_an_empty_part_is_refused_on_every_rank():
    for loss in run_ranks(_evaluate_with_an_empty_part, 2, "fsdp"):
        assert isinstance(loss, str) and "at least one sample" in loss and "sharding 'fsdp'" in loss, loss


def _evaluate_batchnorm(rank, world):
    import hetrain

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=4) for r in range(world)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)).eval()
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    part = x if rank == 0 else x[:0]
    loss = session.evaluate(part, torch.zeros(part.shape[0], 1), torch.nn.functional.mse_loss)
    session.close()
    return loss


def test_an_empty_part_beside_a_model_with_buffers_does_not_hang():
    """DDP's forward broadcasts the model's buffers (BatchNorm's statistics): run through it, the other
    ranks waited in that broadcast for the rank whose part was empty, and both hung."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)).eval()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.nn.functional.mse_loss(net(x), torch.zeros(6, 1)).item()
    for loss in run_ranks(_evaluate_batchnorm, 2, timeout=60):
        assert abs(loss - want) < 1e-6, (loss, want)


def test_evaluating_a_model_in_train_mode_warns_once():
    """Dropout stayed on in session.evaluate (1.124, then 1.162 for one set, 1.157 in eval mode), silently."""
    import logging

    import hetrain

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append   # the session's logger does not pass its lines on to the root's
    logging.getLogger("hetrain").addHandler(handler)

    session = hetrain.Session(Plan(global_batch_size=4, balance=BalancePlan(enabled=False),
                                   ranks=[RankPlan(rank=0, share=4)]))
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = torch.randn(6, 4), torch.zeros(6, 1)
    try:
        session.evaluate(x, y, torch.nn.functional.mse_loss)
        session.evaluate(x, y, torch.nn.functional.mse_loss)
        net.eval()
        first, second = (session.evaluate(x, y, torch.nn.functional.mse_loss) for _ in range(2))
    finally:
        logging.getLogger("hetrain").removeHandler(handler)
        session.close()
    assert sum("evaluate() on a model in train mode" in r.getMessage() for r in records) == 1
    assert first == second   # in eval mode the same set gives the same loss


def _evaluate_every_second_step(rank, world, where_applied):
    import torch.nn.functional as F

    import hetrain
    from hetrain.errors import HetrainError

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=6, micro_batch=2), RankPlan(rank=1, share=2, micro_batch=1)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g))
    x_val, y_val = data.tensors[0][rank::2], data.tensors[1][rank::2]
    evaluated = []
    loader = session.loader(data, 8, shuffle=False)
    try:
        for x, y in loader:
            session.backward(F.mse_loss(model(x), y))
            applied = session.step()
            if (applied or not where_applied) and session.step_count % 2 == 0:
                evaluated.append((session.step_count, round(session.evaluate((x_val,), y_val, F.mse_loss), 6)))
    except HetrainError as e:
        evaluated = str(e)
    session.close()
    return evaluated


def test_evaluating_between_a_steps_micro_batches_is_refused_naming_where_to_evaluate():
    """The usual `step(); if step_count % N == 0: evaluate()` runs once per micro-batch: ranks with different
    numbers of micro-batches paired their evaluations with other collectives (gloo's 'collective mismatch',
    a rank killed by SIGABRT)."""
    for message in run_ranks(_evaluate_every_second_step, 2, False):   # 3 and 2 micro-batches a step
        assert isinstance(message, str) and "where session.step() returns True" in message, message
    ranks = run_ranks(_evaluate_every_second_step, 2, True)
    assert ranks[0] == ranks[1] and [s for s, _ in ranks[0]] == [2, 4]


def _evaluate_hf_style(rank, world):
    """The model takes its labels with its inputs and returns its loss (target None), or a count given as a number:
    refused under data parallelism as 'a pipeline's target must be a tensor' and 'a pipeline cuts the batch'."""
    import hetrain

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=5), RankPlan(rank=1, share=3)])
    session = hetrain.Session(plan)
    torch.manual_seed(0)
    net = tiny_gpt2(context=16)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = PaddedTokens(n=EVAL, length=12, seed=3)
    rows = range(0, 4) if rank == 0 else range(4, EVAL)
    batch = default_collate([data[i] for i in rows])
    by_samples = session.evaluate(batch, None, _lm_loss)
    by_tokens = session.evaluate(batch, None, _lm_loss, num_items=predicted_tokens(batch["labels"]))
    session.close()
    return by_samples, by_tokens


def test_a_model_that_takes_its_labels_evaluates_with_target_none_and_a_number_of_items():
    torch.manual_seed(0)
    net, data = tiny_gpt2(context=16), PaddedTokens(n=EVAL, length=12, seed=3)
    parts = [default_collate([data[i] for i in rows]) for rows in (range(0, 4), range(4, EVAL))]
    with torch.no_grad():
        losses = [net(**part).loss.item() for part in parts]
    tokens = [float(predicted_tokens(part["labels"])) for part in parts]
    by_samples = (losses[0] * 4 + losses[1] * 2) / EVAL
    by_tokens = sum(loss * n for loss, n in zip(losses, tokens)) / sum(tokens)
    for got_samples, got_tokens in run_ranks(_evaluate_hf_style, 2):
        assert abs(got_samples - by_samples) < 1e-5 and abs(got_tokens - by_tokens) < 1e-5


def test_the_items_of_a_batch_are_counted_only_where_its_tensors_agree_on_the_samples():
    """A dict target holding a class-weight vector of 10 beside 6 labels was counted as 10 samples, and a
    detection target as its first image's boxes: the mean was weighted wrongly, without a word."""
    import pytest

    from hetrain.errors import HetrainError
    from hetrain.runtime.evaluation import batch_items

    x, y = torch.randn(6, 3), torch.arange(6)
    assert batch_items(None, x, y) == 6
    assert batch_items(None, {"input_ids": torch.ones(6, 4, dtype=torch.long), "labels": y}, None) == 6
    assert batch_items(None, x, torch.tensor(2.0)) == 6   # a 0-dim target: the inputs' rows
    assert batch_items(5, x, y) == 5 and batch_items(lambda t: (t > 2).sum(), x, y) == 3
    with pytest.raises(HetrainError, match=r"cannot tell the batch's samples from the target \(tensors of 6, 10 rows\)"
                                           r": pass num_items="):
        batch_items(None, x, {"weight": torch.ones(10), "labels": y})
    with pytest.raises(HetrainError, match="pass num_items="):
        batch_items(None, [torch.randn(3, 8, 8)] * 2, [{"boxes": torch.ones(3, 4)}, {"boxes": torch.ones(5, 4)}])
