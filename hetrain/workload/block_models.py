"""Models as the sequence of blocks a pipeline plan partitions, without copying their weights.

`gpt2_blocks(model)` presents a Hugging Face GPT-2 (`GPT2LMHeadModel`) as
`nn.Sequential(embedding, *layers, head)` over the model's own modules, the blocks `hetrain
profile` measures. Its input is `input_ids`, its output the logits; `causal_lm_loss` is the token
mean a causal LM trains on. Right-padded batches need no attention mask: attention is causal,
so padding at the end changes no real token's logits, and padded labels (-100) are not counted.
The input embedding and the output projection share one weight; on different stages each holds
it, and the pipeline sums its gradient across them (`shared_parameters`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

IGNORE = -100


class GPT2Embedding(nn.Module):
    """Token and position embeddings (and GPT-2's embedding dropout)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class GPT2Layer(nn.Module):
    """One transformer block, hidden states in and out."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class GPT2Head(nn.Module):
    """The final layer norm and the projection to the vocabulary."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def gpt2_blocks(model: nn.Module) -> nn.Sequential:
    """A GPT2LMHeadModel as nn.Sequential(embedding, *layers, head), sharing its modules."""
    t = model.transformer
    return nn.Sequential(GPT2Embedding(t.wte, t.wpe, t.drop), *[GPT2Layer(b) for b in t.h],
                         GPT2Head(t.ln_f, model.lm_head))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's next token, over the labels that are not -100."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE)


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The items `causal_lm_loss` averages over (pass as `num_items`)."""
    return (labels[:, 1:] != IGNORE).sum()
