"""A plan's activation checkpointing on a Hugging Face causal LM given an attention mask: the gradient of
plain PyTorch. The model's key/value cache, kept in training forwards too, was filled a second time
when a block recomputed in backward (a shape error)."""

import pytest
import torch

import hetrain
from hetrain.planning.plan import BalancePlan, Plan, RankPlan

transformers = pytest.importorskip("transformers")


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_checkpointed_blocks_of_a_causal_lm_with_an_attention_mask_give_the_plain_gradient(arch):
    ids = torch.randint(3, 64, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    samples = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i].masked_fill(mask[i] == 0, -100)}
               for i in range(4)]
    plan = Plan(global_batch_size=4, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=4, activation_checkpointing=True)])
    with hetrain.Session(plan) as session:
        net = _model(arch)
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for batch in session.loader(samples, global_batch_size=4, shuffle=False):
            out = model(**batch)
            session.backward(out.loss, num_items=(batch["labels"][:, 1:] != -100).sum())
            session.clip_grad_norm_(1e9)   # the step's gradients made final, nothing clipped
            got = {n: p.grad.clone() for n, p in net.named_parameters()}
            session.step()
        # the cache is off in training forwards only: the config saved with the weights keeps it, and a
        # forward without gradients (decoding by hand, generate()) returns it, as before checkpointing
        assert net.config.use_cache is True
        with torch.no_grad():
            assert net(input_ids=ids[:1, :4]).past_key_values is not None
    ref = _model(arch)
    ref(**{k: torch.stack([s[k] for s in samples]) for k in samples[0]}).loss.backward()
    worst = max((got[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    assert worst < 1e-6, worst


class _LM(torch.nn.Module):
    """Two checkpointed layers and a config with the cache on; forward returns the use_cache it was given."""

    def __init__(self):
        super().__init__()
        self.config = transformers.GPT2Config()   # use_cache True
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def run(self, x, use_cache):
        for layer in self.layers:
            x = layer(x)
        return x, use_cache


class _Positional(_LM):
    def forward(self, x, use_cache=None):
        return self.run(x, use_cache)


class _AfterArgs(_LM):
    def forward(self, x, *extra, use_cache=None):
        return self.run(x, use_cache)


def _checkpointed(cls):
    from hetrain.runtime.memory import apply_activation_checkpointing

    model = cls()
    apply_activation_checkpointing(model)
    return model


def test_use_cache_given_positionally_is_left_to_the_caller():
    """The hook that turns the cache off in training forwards added use_cache=False to a call that passed it
    positionally: 'got multiple values for argument use_cache'."""
    model, x = _checkpointed(_Positional), torch.randn(2, 4)
    assert model(x, True)[1] is True and model(x)[1] is False and model(x, use_cache=True)[1] is True
    with torch.no_grad():
        assert model(x)[1] is None   # a forward without gradients keeps the model's own default


def test_use_cache_after_a_variable_count_of_positional_arguments_is_found_by_name():
    """forward(x, *extra, use_cache=None): its position was taken as 1, so a call with two or more
    positional arguments kept the cache in a training forward."""
    model, x = _checkpointed(_AfterArgs), torch.randn(2, 4)
    assert [model(*([x] * n))[1] for n in (1, 2, 3)] == [False, False, False]
