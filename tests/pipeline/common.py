"""A small sequential model, its data and the one-process reference the pipeline tests compare with."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from hetrain.planning.plan import BalancePlan, PipelinePlan, Plan, RankPlan
from hetrain.runtime.data import GlobalBatchOrder

WIDTH, CLASSES, FEATURES, LR = 16, 5, 6, 0.2


class Block(nn.Module):
    """A residual MLP block, as a transformer layer would be."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def make_model(layers: int = 6, seed: int = 0) -> nn.Sequential:
    """embed, `layers` blocks, head: layers + 2 blocks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), *[Block() for _ in range(layers)], nn.Linear(WIDTH, CLASSES))


def make_data(n: int = 96, seed: int = 1, ignored: bool = False) -> TensorDataset:
    """Features and classes; with `ignored`, about a third of the labels are -100 (items the loss skips)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    if ignored:
        y[torch.rand(n, generator=g) < 0.35] = -100
    return TensorDataset(x, y)


def count_labels(y: torch.Tensor) -> torch.Tensor:
    """The items a token-mean loss averages over."""
    return (y != -100).sum()


def pipeline_plan(stages: list[list[int]], schedule: str, microbatches: int, global_batch: int,
                  replica_shares: list[int] | None = None, precisions: list[str] | None = None) -> Plan:
    """Ranks 0..p-1 are replica 0's stages, p..2p-1 replica 1's, and so on."""
    shares = replica_shares or [global_batch]
    p = len(stages)
    ranks = [RankPlan(rank=i * p + j, share=shares[i], stage=j, precision=(precisions or ["fp32"] * p)[j])
             for i in range(len(shares)) for j in range(p)]
    return Plan(global_batch_size=global_batch, strategy="pipeline" if len(shares) == 1 else "hybrid", ranks=ranks,
                balance=BalancePlan(enabled=False),
                pipeline=PipelinePlan(stages=stages, schedule=schedule, microbatches=microbatches))


def reference(steps: int, global_batch: int, layers: int = 6, bf16_blocks: int = 0,
              ignored: bool = False, drop_last: bool = True) -> list[dict[str, torch.Tensor]]:
    """One process, the whole global batch, its mean loss; the first `bf16_blocks` blocks under bf16 autocast.
    One thread, as each rank has: bf16 reductions split over threads round differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(steps, global_batch, layers, bf16_blocks, ignored, drop_last)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int, global_batch: int, layers: int, bf16_blocks: int,
               ignored: bool, drop_last: bool) -> list[dict[str, torch.Tensor]]:
    model, data = make_model(layers), make_data(ignored=ignored)
    order = GlobalBatchOrder(len(data), global_batch, shuffle=True, seed=0, drop_last=drop_last)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        epoch, in_epoch = divmod(step, order.steps_per_epoch)
        x, y = data[order.global_batch(epoch, in_epoch)]
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16_blocks else contextlib.nullcontext():
            h = model[:bf16_blocks](x) if bf16_blocks else x
        h = model[bf16_blocks:](h.float())
        F.cross_entropy(h, y).backward()
        opt.step()
        opt.zero_grad()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def train(rank: int, world: int, plan: Plan, steps: int, layers: int = 6, ignored: bool = False,
          checkpoint_dir: str | None = None, adam: bool = False, drop_last: bool = True,
          seed_by_rank: bool = False) -> dict:
    """The user's one script: the same loop for a data-parallel or a pipeline plan. With `seed_by_rank` each
    rank initialises the model from its own seed (a common habit): the job still trains rank 0's model."""
    import hetrain

    session = hetrain.Session(plan, checkpoint_dir=checkpoint_dir, checkpoint_interval=2, async_checkpoints=False)
    net = make_model(layers, seed=rank if seed_by_rank else 0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01) if adam else torch.optim.SGD(net.parameters(), lr=LR)
    model, _ = session.prepare(net, opt)
    loader = session.loader(make_data(ignored=ignored), global_batch_size=plan.global_batch_size, shuffle=True, seed=0,
                            drop_last=drop_last)
    states, losses = [], []
    while session.step_count < steps:   # across epochs where a test runs more steps than one has
        for x, y in loader:
            session.forward_backward(x, y, F.cross_entropy, num_items=count_labels if ignored else None)
            session.clip_grad_norm_(1e9)
            session.step()
            inner = getattr(model, "module", model)   # DDP wraps the model; a pipeline stage is its own
            full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in inner.state_dict().items()}
            states.append({k: v.detach().clone() for k, v in full.items()})
            losses.append(session.loss)
            if session.step_count == steps:
                break
    from hetrain.runtime.memory import is_checkpointed

    checkpointed = sum(is_checkpointed(b) for b in session.blocks)
    session.close()
    return {"states": states, "losses": losses, "checkpointed": checkpointed}


def worst_difference(results: list[dict], want: list[dict[str, torch.Tensor]]) -> float:
    """The largest |difference| of any parameter after any step, over every rank's stage."""
    worst = 0.0
    for result in results:
        assert len(result["states"]) == len(want)
        for got, ref in zip(result["states"], want):
            assert got, "a stage holds no parameters"
            for name, value in got.items():
                worst = max(worst, (value - ref[name]).abs().max().item())
    return worst
