"""A Hugging Face GPT-2 (tied input and output embeddings) as pipeline stages: the token-mean update
and the clipped norm of one process running the model on the whole global batch."""

import torch
from torch.utils.data import default_collate

from hetrain.bench.tiny_lm import PaddedTokens, tiny_gpt2
from hetrain.runtime.pipeline_models import causal_lm_loss, gpt2_blocks, predicted_tokens
from tests.distributed import run_ranks
from tests.pipeline.common import pipeline_plan

GLOBAL, STEPS, LR, CLIP = 8, 3, 0.5, 0.5


def data() -> PaddedTokens:
    return PaddedTokens(n=64, length=12, seed=5)


def model(frozen_embedding: bool = False) -> torch.nn.Module:
    hf = tiny_gpt2(context=16, layers=4)
    hf.transformer.wte.weight.requires_grad_(not frozen_embedding)   # tied: the head's weight too
    return hf


def reference(frozen_embedding: bool = False) -> dict[str, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf = model(frozen_embedding)
    opt = torch.optim.SGD([p for p in hf.parameters() if p.requires_grad], lr=LR)
    tokens = data()
    for step in range(STEPS):
        batch = default_collate([tokens[i] for i in range(step * GLOBAL, (step + 1) * GLOBAL)])
        hf(**batch).loss.backward()                  # Hugging Face's own forward, attention mask included
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in gpt2_blocks(hf).state_dict().items()}


def _train(rank, world, plan, frozen_embedding=False):
    import hetrain

    session = hetrain.Session(plan)
    net = gpt2_blocks(model(frozen_embedding))
    trained, _ = session.prepare(net, torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR))
    loader = session.loader(data(), global_batch_size=GLOBAL, shuffle=False)
    for batch in loader:
        session.forward_backward(batch["input_ids"], batch["labels"], causal_lm_loss, num_items=predicted_tokens)
        session.clip_grad_norm_(CLIP)
        session.step()
        if session.step_count == STEPS:
            break
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trained.state_dict().items()}
    session.close()
    return {k: v.detach().clone() for k, v in state.items()}


def _check(results, frozen_embedding=False):
    want = reference(frozen_embedding)
    seen = set()
    for state in results:
        for name, value in state.items():
            assert (value - want[name]).abs().max().item() < 1e-5, name
            seen.add(name)
    assert seen == set(want)
    assert {"0.wte.weight", "5.lm_head.weight"} <= seen


def test_gpt2_two_stages_with_tied_embeddings():
    _check(run_ranks(_train, 2, pipeline_plan([[0, 3], [3, 6]], "1f1b", microbatches=4, global_batch=GLOBAL)))


def test_gpt2_hybrid_with_unequal_replica_shares():
    plan = pipeline_plan([[0, 2], [2, 6]], "gpipe", microbatches=2, global_batch=GLOBAL, replica_shares=[6, 2])
    _check(run_ranks(_train, 4, plan))


def test_gpt2_fsdp2_stages_with_tied_embeddings():
    plan = pipeline_plan([[0, 3], [3, 6]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[5, 3])
    _check(run_ranks(_train, 4, plan.model_copy(update={"sharding": "fsdp"})))


def test_gpt2_frozen_tied_embedding():
    """No gradient to sum across the stages holding it (clip_grad_norm_ met its None gradient before)."""
    plan = pipeline_plan([[0, 3], [3, 6]], "1f1b", microbatches=4, global_batch=GLOBAL)
    _check(run_ranks(_train, 2, plan, True), frozen_embedding=True)
