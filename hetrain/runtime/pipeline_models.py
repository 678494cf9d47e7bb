"""Models as the sequence of blocks a pipeline plan partitions (`gpt2_blocks`), and the causal LM loss
and item count that go with them: kept here for scripts, defined in hetrain.workload.block_models
(where `hetrain profile` builds the same form)."""

from hetrain.workload.block_models import (IGNORE, GPT2Embedding, GPT2Head, GPT2Layer, causal_lm_loss, gpt2_blocks,
                                           predicted_tokens)

__all__ = ["IGNORE", "GPT2Embedding", "GPT2Head", "GPT2Layer", "causal_lm_loss", "gpt2_blocks", "predicted_tokens"]
