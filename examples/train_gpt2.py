"""A small GPT-2 (built from a Hugging Face GPT2Config, nothing downloaded) on variable-length,
padded token sequences: the token-mean loss, gradient clipping and checkpoints. On 2 CPU ranks:

    hetrain launch --nproc-per-node 2 --emulate-speeds 1,0.5 --checkpoint-dir /tmp/gpt2 \\
        examples/train_gpt2.py --steps 60

The loss is the mean over this rank's predicted tokens; `num_items` tells hetrain how many, so
the update is the gradient of the mean over every token of the global batch, however the batch
is split and whatever the ranks' precisions. `session.forward_backward` runs the step under any
plan: data parallel, or pipeline stages (`hetrain launch --plan` with a pipeline plan; the model
is GPT-2 as a sequence of blocks a plan can partition). Needs `transformers`.
"""

import argparse

import torch

import hetrain
from hetrain.bench.tiny_lm import PaddedTokens, tiny_gpt2
from hetrain.runtime.pipeline_models import causal_lm_loss, gpt2_blocks, predicted_tokens

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--global-batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--max-grad-norm", type=float, default=1.0)
parser.add_argument("--layers", type=int, default=2)
args = parser.parse_args()

session = hetrain.Session()
model = gpt2_blocks(tiny_gpt2(vocab=64, context=32, width=64, layers=args.layers, heads=4))
model, optimizer = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
# a linear warm-up over the first tenth of the steps: stepped, saved and resumed by the session
session.add_scheduler(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.steps / 10))))
loader = session.loader(PaddedTokens(n=2048, length=24), global_batch_size=args.global_batch_size, seed=0)

while session.step_count < args.steps:
    for batch in loader:                                   # a dict of tensors on this rank's device
        # forward under this rank's precision, mean over its predicted tokens, backward weighted by them
        session.forward_backward(batch["input_ids"], batch["labels"], causal_lm_loss, num_items=predicted_tokens)
        norm = session.clip_grad_norm_(args.max_grad_norm)
        if not session.step():
            continue                                       # a micro-batch, or a skipped step
        if session.is_main and session.step_count % 10 == 0:
            print(f"step {session.step_count} loss {session.loss:.4f} grad norm {float(norm):.3f} "
                  f"shares {session.shares}", flush=True)
        if session.step_count >= args.steps:
            break
session.close()
