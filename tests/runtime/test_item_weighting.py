"""Token-mean losses give the exact global-batch update: any split, micro-batches, a rank with no tokens."""

import pytest
import torch
from torch.utils.data import default_collate

from hetrain.bench.tiny_lm import PaddedTokens, predicted_tokens, tiny_gpt2
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks

GLOBAL = 8
LR = 0.5
# Shares per step: uneven, changing between steps; rank 2's only sample of step 0 has no predicted token.
SPLITS = [[5, 2, 1], [3, 4, 1], [2, 2, 4]]


def lm_data() -> PaddedTokens:
    data = PaddedTokens(n=64, length=12, seed=5)
    data.attention_mask[7] = 0
    data.attention_mask[7, 0] = 1       # one real token: nothing to predict
    data.labels[7] = data.input_ids[7].masked_fill(data.attention_mask[7] == 0, -100)
    return data


def reference(steps: int) -> list[list[torch.Tensor]]:
    """One process, the whole global batch, the token mean over all of it."""
    net, data = tiny_gpt2(context=16), lm_data()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    out = []
    for step in range(steps):
        batch = default_collate([data[i] for i in range(step * GLOBAL, (step + 1) * GLOBAL)])
        net(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in net.parameters()])
    return out


def _train(rank, world, sharding, micro_batch, steps):
    import hetrain

    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False, min_share=0),
                ranks=[RankPlan(rank=r, share=s, micro_batch=micro_batch.get(r)) for r, s in enumerate(SPLITS[0])])
    session = hetrain.Session(plan)
    net = tiny_gpt2(context=16)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    loader = session.loader(lm_data(), global_batch_size=GLOBAL, shuffle=False)
    params, losses = [], []
    for batch in loader:
        loss = model(**batch).loss                        # mean over this piece's predicted tokens
        session.backward(loss, num_items=predicted_tokens(batch["labels"]))
        before = session.step_count
        session.step()
        if session.step_count == before:
            continue                                      # a micro-batch: the step goes on
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        params.append([p.detach().clone() for p in full])
        losses.append(session.loss)
        if session.step_count == steps:
            break
        session.balancer.shares = list(SPLITS[session.step_count])   # re-split between steps
    session.close()
    return {"params": params, "losses": losses}


def _check(sharding, micro_batch):
    steps = len(SPLITS)
    results = run_ranks(_train, 3, sharding, micro_batch, steps)
    want = reference(steps)
    net, data = tiny_gpt2(context=16), lm_data()
    first = default_collate([data[i] for i in range(GLOBAL)])
    with torch.no_grad():
        first_loss = net(**first).loss.item()
    for rank in range(3):
        assert len(results[rank]["params"]) == steps
        assert abs(results[rank]["losses"][0] - first_loss) < 1e-5
        for step in range(steps):
            worst = max((g - w).abs().max().item() for g, w in zip(results[rank]["params"][step], want[step]))
            assert worst < 1e-5, (sharding, rank, step, worst)


def test_token_mean_ddp_with_changing_split_zero_token_rank_and_micro_batches():
    _check("none", {0: 2})


def test_token_mean_without_micro_batches_equals_with_them():
    _check("none", {})


def test_token_mean_fsdp2():
    _check("fsdp", {1: 1})


def _no_items_first(rank, world):
    import hetrain

    plan = Plan(global_batch_size=GLOBAL, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=GLOBAL // world) for r in range(world)])
    session = hetrain.Session(plan)
    net, data = tiny_gpt2(context=16), lm_data()
    data.labels[:GLOBAL] = -100                           # the first global batch: prompts only, nothing to predict
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.5)
    model, _ = session.prepare(net, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    session.add_scheduler(scheduler)
    loader = session.loader(data, global_batch_size=GLOBAL, shuffle=False)
    start = [p.detach().clone() for p in net.parameters()]
    applied, moved = [], []
    for batch in loader:
        session.backward(model(**batch).loss, num_items=predicted_tokens(batch["labels"]))
        applied.append(session.step())
        moved.append(max((p - s).abs().max().item() for p, s in zip(net.parameters(), start)))
        if session.step_count == 2:
            break
    figures = {"applied": applied, "moved": moved, "epoch": scheduler.last_epoch, "skipped": session.skips.total}
    session.close()
    return figures


def test_a_global_batch_without_items_leaves_the_weights_and_schedules_as_they_are():
    """A token-mean step over prompts only (0 items on every rank) was applied as a zero-gradient update:
    AdamW's weight decay moved the weights (0.01) and the schedule advanced, with no word."""
    for r in run_ranks(_no_items_first, 2):
        assert r["applied"] == [False, True] and r["moved"][0] == 0.0 and r["moved"][1] > 0, r
        assert r["epoch"] == 1 and r["skipped"] == 0, r


def test_a_step_without_items_keeps_a_run_of_skips_and_applies_what_a_lossy_compression_carries():
    """A step without items ended a run of skipped steps (so skips between such steps never stopped the job);
    under top-k, int8 or PowerSGD it threw away the part of earlier gradients the hook had sent."""
    from hetrain.runtime.gradients import GradientStatus, SkipCounter

    skips = SkipCounter(limit=3)
    inf, empty = GradientStatus(True, 8.0, None), GradientStatus(False, 0.0, None)
    assert skips.count(False, 1, 1.0, False) == 1 and skips.in_a_row == 1
    assert skips.without_items(empty, 2, False) and skips.count(False, 2, 1.0, False) == 0
    assert skips.in_a_row == 1 and skips.total == 1                    # neither counted nor a reset
    assert not skips.without_items(inf, 3, False) and skips.count(False, 3, 1.0, False) == 1
    assert not SkipCounter(limit=3, carried=True).without_items(empty, 1, False)   # error feedback: applied


AUX = 0.5   # the weight of a per-sample auxiliary loss beside the token mean


def _ce_sum(logits, labels):
    """The summed next-token cross-entropy over predicted tokens (0 over none, where a mean is 0/0)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")


def _aux(logits):
    """A per-sample mean: something a second head would compute from each sample (here its first logits)."""
    return logits[:, 0].pow(2).mean(-1).mean()


def _reference_two_means(steps):
    net, data = tiny_gpt2(context=16), lm_data()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    out = []
    for step in range(steps):
        batch = default_collate([data[i] for i in range(step * GLOBAL, (step + 1) * GLOBAL)])
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        (_ce_sum(logits, batch["labels"]) / predicted_tokens(batch["labels"]) + AUX * _aux(logits)).backward()
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in net.parameters()])
    return out


def _train_two_means(rank, world, sharding, steps):
    """docs/porting.md, "Two means of one batch": the token mean re-expressed per sample with the global batch's
    tokens per sample, then one session.backward() of a sample mean."""
    import hetrain

    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False, min_share=0),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate(SPLITS[0])])
    session = hetrain.Session(plan)
    net = tiny_gpt2(context=16)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    params = []
    for batch in session.loader(lm_data(), global_batch_size=GLOBAL, shuffle=False):
        samples, tokens = len(batch["labels"]), predicted_tokens(batch["labels"])
        tokens_per_sample = session.global_mean(tokens / samples, weight=samples)   # the global batch's
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        session.backward(_ce_sum(logits, batch["labels"]) / (samples * tokens_per_sample) + AUX * _aux(logits))
        session.step()
        params.append([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for p in model.parameters()])
        if session.step_count == steps:
            break
        session.balancer.shares = list(SPLITS[session.step_count])
    session.close()
    return params


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_a_token_mean_beside_a_sample_mean_gives_the_one_process_update(sharding):
    """One call of both means with one item count weighted one of them wrongly on uneven shares (39% off the
    gradient with num_items=tokens, 96% with the samples); the documented form is exact, a rank without
    tokens included."""
    want = _reference_two_means(len(SPLITS))
    for got in run_ranks(_train_two_means, 3, sharding, len(SPLITS)):
        for step, (g, w) in enumerate(zip(got, want)):
            worst = max((a - b).abs().max().item() for a, b in zip(g, w))
            assert worst < 1e-5, (sharding, step, worst)
