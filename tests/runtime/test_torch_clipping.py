"""A ported loop keeps torch.nn.utils.clip_grad_norm_ between session.backward and session.step: on 2 ranks
with unequal shares and a token-mean loss it clips the global batch's gradient as one process does."""

import pytest
import torch
from torch.utils.data import default_collate

from hetrain.bench.tiny_lm import PaddedTokens, predicted_tokens, tiny_gpt2
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from tests.distributed import run_ranks

GLOBAL, LR, MAX_NORM, STEPS = 8, 0.5, 0.3, 3


def _data() -> PaddedTokens:
    return PaddedTokens(n=64, length=12, seed=5)


def _reference() -> tuple[list[float], list[torch.Tensor]]:
    net, data = tiny_gpt2(context=16), _data()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        net(**default_collate([data[i] for i in range(step * GLOBAL, (step + 1) * GLOBAL)])).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return norms, [p.detach().clone() for p in net.parameters()]


def _train(rank, world, sharding, micro_batch):
    import hetrain

    plan = Plan(global_batch_size=GLOBAL, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=5, micro_batch=micro_batch), RankPlan(rank=1, share=3)])
    session = hetrain.Session(plan)
    net = tiny_gpt2(context=16)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    norms = []
    for batch in session.loader(_data(), global_batch_size=GLOBAL, shuffle=False):
        session.backward(model(**batch).loss, num_items=predicted_tokens(batch["labels"]))
        if session.state.last_micro:   # the habit: torch's clipping on the step's last micro-batch
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        session.step()
        if session.step_count == STEPS:
            break
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    session.close()
    return norms, params


@pytest.mark.parametrize("sharding,micro_batch", [("none", None), ("zero1", None), ("fsdp", None), ("none", 2)])
def test_torch_clipping_after_backward_matches_one_process(sharding, micro_batch):
    """It measured the second step's norm at 1.49 where one process's is 1.17 (the gradient still weighted by
    an estimated token count) and trained 4.9e-3 away from one process in 3 steps, silently."""
    want_norms, want = _reference()
    for norms, params in run_ranks(_train, 2, sharding, micro_batch):
        assert norms == pytest.approx(want_norms, rel=1e-5), (norms, want_norms)
        assert max((a - b).abs().max().item() for a, b in zip(params, want)) < 1e-6
