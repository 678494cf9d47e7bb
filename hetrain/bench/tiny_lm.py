"""A small causal language model and variable-length token data, for examples, tests and benchmarks.

The model is Hugging Face's GPT-2 built from a config (nothing is downloaded; `transformers` is
needed). The data are sequences of different lengths that follow a learnable rule (each token is
the previous one plus a per-sequence step, modulo the vocabulary), right-padded to one length,
with labels -100 on the padding, as a tokenizer and collator would produce them.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from hetrain.runtime.pipeline_models import IGNORE, predicted_tokens  # noqa: F401  (the token count of a batch)


def tiny_gpt2(vocab: int = 64, context: int = 32, width: int = 32, layers: int = 2, heads: int = 2,
              seed: int = 0) -> torch.nn.Module:
    """GPT2LMHeadModel from a GPT2Config, without dropout (so runs are reproducible)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"   # the token-mean causal LM loss, named so transformers does not warn
    return model


class PaddedTokens(Dataset):
    """Samples {input_ids, attention_mask, labels} of lengths in [min_len, length], padded to `length`."""

    def __init__(self, n: int = 256, length: int = 16, vocab: int = 64, min_len: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.zeros(n, length, dtype=torch.long)
        self.attention_mask = torch.zeros(n, length, dtype=torch.long)
        lengths = torch.randint(min_len, length + 1, (n,), generator=g)
        starts = torch.randint(1, vocab, (n,), generator=g)
        steps = torch.randint(1, 4, (n,), generator=g)
        for i in range(n):
            k = int(lengths[i])
            self.input_ids[i, :k] = (starts[i] + steps[i] * torch.arange(k)) % (vocab - 1) + 1
            self.attention_mask[i, :k] = 1
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, IGNORE)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}
