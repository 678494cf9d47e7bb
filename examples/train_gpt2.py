"""A small GPT-2 (built from a Hugging Face GPT2Config, nothing downloaded) on variable-length,
padded token sequences: the token-mean loss, gradient clipping and checkpoints. On 2 CPU ranks:

    hetrain launch --nproc-per-node 2 --emulate-speeds 1,0.5 --checkpoint-dir /tmp/gpt2 \\
        examples/train_gpt2.py --steps 60

The loss is the mean over this rank's predicted tokens; `num_items` tells hetrain how many, so
the update is the gradient of the mean over every token of the global batch, however the batch
is split and whatever the ranks' precisions. Needs `transformers`.
"""

import argparse

import torch

import hetrain
from hetrain.bench.tiny_lm import PaddedTokens, predicted_tokens, tiny_gpt2

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--global-batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--max-grad-norm", type=float, default=1.0)
parser.add_argument("--layers", type=int, default=2)
args = parser.parse_args()

session = hetrain.Session()
model = tiny_gpt2(vocab=64, context=32, width=64, layers=args.layers, heads=4)
model, optimizer = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
loader = session.loader(PaddedTokens(n=2048, length=24), global_batch_size=args.global_batch_size, seed=0)

while session.step_count < args.steps:
    for batch in loader:                                   # a dict of tensors on this rank's device
        with session.autocast():
            loss = model(**batch).loss                     # mean over this rank's predicted tokens
        session.backward(loss, num_items=predicted_tokens(batch["labels"]))
        norm = session.clip_grad_norm_(args.max_grad_norm)
        if not session.step():
            continue                                       # a micro-batch, or a skipped step
        if session.is_main and session.step_count % 10 == 0:
            print(f"step {session.step_count} loss {session.loss:.4f} grad norm {float(norm):.3f} "
                  f"shares {session.shares}", flush=True)
        if session.step_count >= args.steps:
            break
session.close()
