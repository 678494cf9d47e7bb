"""The ranks of `hetrain bench memory` (hetrain/bench/memory.py): each memory strategy on CPU ranks over
gloo, optimizer-state and saved-activation bytes per rank. Kept apart from the verb so that its flags
are checked before torch is imported."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hetrain.bench.memory import CAPACITY_PATTERN
from hetrain.runtime.environment import collect_at_exit
from hetrain.vocabulary import SHARDINGS


class TinyTransformer(nn.Module):
    """Token embedding, a ModuleList of encoder blocks, a vocabulary head."""

    def __init__(self, width: int, depth: int, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True)
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _measure(rank: int, world: int, args: argparse.Namespace, sharding: str, ckpt: bool) -> dict:
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan
    from hetrain.runtime.memory import SavedActivations
    from hetrain.runtime.sharding import optimizer_state_bytes

    from hetrain.planning.batch_split import split_even

    ranks = [RankPlan(rank=r, share=n, activation_checkpointing=ckpt, memory_capacity_bytes=CAPACITY_PATTERN[r % 2])
             for r, n in enumerate(split_even(args.global_batch_size, world))]
    plan = Plan(global_batch_size=args.global_batch_size, sharding=sharding, ranks=ranks,
                balance=BalancePlan(enabled=False))
    session = hetrain.Session(plan)
    # the head, a Linear over (batch, seq, width), returns a view, which FSDP2 warns about for the
    # whole module (an in-place op on it would skip the module's backward hook); nothing here does one
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPTinyTransformer\) returned a view")
    torch.manual_seed(0)
    net = TinyTransformer(args.width, args.depth)
    model, optimizer = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randint(0, 128, (args.global_batch_size * 2, args.seq + 1), generator=g))
    loader = session.loader(data, global_batch_size=args.global_batch_size, shuffle=False)
    (tokens,) = next(iter(loader))
    meter = SavedActivations(net, session.blocks)
    with meter.measure():
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    session.backward(loss)
    session.step()
    return {"optimizer_state_bytes": optimizer_state_bytes(optimizer), "saved_activation_bytes": meter.bytes,
            "samples": len(tokens), "loss": loss.item()}


def _rank_main(rank: int, world: int, args: argparse.Namespace, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    collect_at_exit()   # at exit: collect, and let gloo's workers free their last tensors (settle_at_exit)
    results = {f"{s}{'+ckpt' if c else ''}": _measure(rank, world, args, s, c) for s in SHARDINGS for c in (False, True)}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def measured(args: argparse.Namespace) -> dict:
    """Per strategy, per rank: optimizer-state bytes, saved-activation bytes (spawns `args.ranks` ranks)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        mp.spawn(_rank_main, args=(args.ranks, args, store, out), nprocs=args.ranks, join=True)
        with open(out) as f:
            per_rank = json.load(f)
    strategies = {}
    for name in per_rank[0]:
        strategies[name] = {k: [r[name][k] for r in per_rank] for k in per_rank[0][name]}
    return strategies


def parameters(width: int, depth: int) -> int:
    """Parameters of the benchmark's transformer."""
    return sum(p.numel() for p in TinyTransformer(width, depth).parameters())
