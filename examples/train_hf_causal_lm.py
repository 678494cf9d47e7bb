"""A Hugging Face causal LM as its users train it: the model's own loss, an attention mask, a padding
collate, AdamW with a warm-up, gradient clipping, and save_pretrained at the end. On 2 CPU ranks:

    hetrain launch --nproc-per-node 2 --emulate-speeds 1,0.5 examples/train_hf_causal_lm.py --out /tmp/lm

What hetrain changes: the loader (global batches split by speed), `session.autocast()` (each rank in
its plan's precision; fp16 ranks get the job's loss scale), `session.backward(loss, num_items=...)`
(HF's loss is the mean over this rank's predicted tokens; with their count the update is the mean
over every token of the global batch, whatever the split), `session.clip_grad_norm_`,
`session.step()`, the scheduler given to the session, and the save: `session.model_state_dict()`
gathers the whole model (FSDP2 shards, pipeline stages) on rank 0, which writes it. Built from a config:
nothing downloaded.
"""

import argparse

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import hetrain

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--global-batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--out", default=None, help="where rank 0 saves the trained model (save_pretrained)")
args = parser.parse_args()


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 4 to 24 tokens counting up by a step of 1 to 3 (a pattern a small model learns)."""

    def __init__(self, n: int = 2048, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = [(int(torch.randint(1, vocab, (), generator=g)) + int(torch.randint(1, 4, (), generator=g))
                      * torch.arange(int(torch.randint(4, 25, (), generator=g)))) % (vocab - 1) + 1 for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch; padding is masked and ignored by the loss (-100)."""
    input_ids = pad_sequence(rows, batch_first=True, padding_value=0)
    attention_mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_value=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


if __name__ == "__main__":
    session = hetrain.Session()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0))
    model, optimizer = session.prepare(net, torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01))
    session.add_scheduler(get_linear_schedule_with_warmup(optimizer, args.steps // 10, args.steps))
    loader = session.loader(Sequences(), global_batch_size=args.global_batch_size, collate_fn=collate)
    while session.step_count < args.steps:
        for batch in loader:
            with session.autocast():
                loss = model(**batch).loss                         # mean over this rank's predicted tokens
            session.backward(loss, num_items=(batch["labels"][:, 1:] != -100).sum())   # HF shifts the labels
            session.clip_grad_norm_(1.0)
            stepped = session.step()   # False after a micro-batch that is not its step's last
            if stepped and session.is_main and session.step_count % 20 == 0:
                print(f"step {session.step_count} loss {session.loss:.4f}", flush=True)
            if session.step_count >= args.steps:
                break
    if args.out:   # every rank gathers the whole model (collective under FSDP2 and pipelines), rank 0 writes it
        full = session.model_state_dict()
        if session.is_main:
            net.save_pretrained(args.out, state_dict=full)
    session.close()
