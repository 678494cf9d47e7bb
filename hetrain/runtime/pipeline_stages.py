"""Pipeline layout and stage modules: which rank runs which stage of which replica, and the
stage's part of the model, built from the plan's partition of the model's blocks.

A pipeline plan gives each rank a `stage`; the ranks of one stage are that stage's replicas
(data parallel over pipelines: hybrid). Replica i is the i-th rank (in rank order) of every
stage. Each replica takes its share of the global batch (the plan's `share` of its ranks); the
loader reads that share spread over the replica's ranks, and the ranks gather it (see
`hetrain.runtime.pipeline_schedule`). Under interleaved 1F1B the rank of stage j holds the
pipeline's stages j, j + p, ... (one per chunk); elsewhere its stage is one of the plan's stages.

The model is an `nn.Sequential` whose children are the blocks the plan partitions (the same
blocks `hetrain profile` measures: embedding, layers, head). A stage module is an `nn.Sequential`
(`StageBlocks`) of its blocks under their original names ("3", "4", ...), so its `state_dict` keys are
the whole model's keys and any partition can load a checkpoint written under another.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ContextManager
from dataclasses import dataclass

import torch
from torch import nn

from hetrain.errors import HetrainError
from hetrain.planning.batch_split import split_proportional
from hetrain.planning.plan import PipelinePlan, Plan, RankPlan
from hetrain.vocabulary import PIPELINE_STRATEGIES


@dataclass(frozen=True)
class PipelineLayout:
    """Ranks by (replica, stage), and this rank's place in that grid."""

    grid: list[list[int]]        # grid[replica][stage] = global rank
    replica: int
    stage: int

    @property
    def stages(self) -> int:
        return len(self.grid[0])

    @property
    def replicas(self) -> int:
        return len(self.grid)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def replica_ranks(self, replica: int | None = None) -> list[int]:
        """The ranks of one replica (this rank's by default), in stage order."""
        return self.grid[self.replica if replica is None else replica]

    def stage_ranks(self, stage: int | None = None) -> list[int]:
        """The ranks holding one stage (this rank's by default), one per replica."""
        j = self.stage if stage is None else stage
        return [row[j] for row in self.grid]


def pipeline_layout(entries: Sequence[RankPlan], pipeline: PipelinePlan, rank: int) -> PipelineLayout:
    """The (replica, stage) grid of a pipeline plan's entries (by actual rank)."""
    p = pipeline.ranks_per_pipeline
    by_stage: list[list[int]] = [[] for _ in range(p)]
    for e in sorted(entries, key=lambda e: e.rank):
        if e.stage >= p:
            raise HetrainError(f"rank {e.rank} runs stage {e.stage}, but the plan's pipeline spans {p} ranks "
                               f"(pipeline.stages over pipeline.chunks); give each rank a stage in 0..{p - 1} or re-plan")
        by_stage[e.stage].append(e.rank)
    counts = [len(s) for s in by_stage]
    if len(set(counts)) != 1 or counts[0] == 0:
        raise HetrainError(f"pipeline stages have {counts} ranks each; every stage needs the same number of ranks "
                           "(one per replica): re-plan with `hetrain plan --strategy pipeline` for these devices")
    grid = [[by_stage[j][i] for j in range(p)] for i in range(counts[0])]
    if pipeline.schedule == "interleaved-1f1b" and any(row != sorted(row) for row in grid):
        # torch's multi-stage schedules place stage s on group rank s % p, and a group orders its ranks.
        device = {e.rank: e.device for e in entries}
        order = ", ".join(f"rank {r}: {device[r]} (stage {j})" for row in grid for j, r in sorted(
            ((j, r) for j, r in enumerate(row)), key=lambda jr: jr[1]))
        raise HetrainError(
            f"this interleaved-1f1b plan runs stage s of a pipeline on its s-th rank, but the ranks' devices came "
            f"in another order than the plan's ({order}); torch's interleaved schedule cannot follow it. Plan "
            "with the devices in this job's rank order (hetrain plan --devices lists rank 0's first), or start "
            "the ranks in the plan's order (CUDA_VISIBLE_DEVICES on one node, --node-rank across nodes)")
    where = next((i, j) for i, row in enumerate(grid) for j, r in enumerate(row) if r == rank)
    return PipelineLayout(grid=grid, replica=where[0], stage=where[1])


def replica_shares(entries: Sequence[RankPlan], layout: PipelineLayout, global_batch_size: int) -> list[int]:
    """Samples of each global batch per replica: the plan's share of the replica's first-stage rank,
    re-split in proportion when they do not add up to the global batch (another device count)."""
    by_rank = {e.rank: e for e in entries}
    shares = [by_rank[row[0]].share for row in layout.grid]
    if sum(shares) != global_batch_size:
        floor = max(global_batch_size * 1e-3, 1e-6)
        shares = split_proportional(global_batch_size, [max(float(s), floor) for s in shares])
    return shares


def loader_shares(layout: PipelineLayout, shares: Sequence[int], world_size: int) -> list[int]:
    """Per rank, the samples the loader reads: each replica's share spread over its stages' ranks."""
    out = [0] * world_size
    for row, share in zip(layout.grid, shares):
        for r, n in zip(row, split_proportional(share, [1.0] * len(row))):
            out[r] = n
    return out


def model_blocks(model: nn.Module, pipeline: PipelinePlan) -> list[tuple[str, nn.Module]]:
    """The model's blocks by name, checked against the plan's partition."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Sequential):
        raise HetrainError(
            "a pipeline plan splits the model into stages, which a model compiled whole (torch.compile(model)) "
            "cannot be; compile each block in place before session.prepare(): for block in model: block.compile()")
    if not isinstance(model, nn.Sequential):
        raise HetrainError(
            f"a pipeline plan needs the model as nn.Sequential of its blocks (embedding, layers, head), got "
            f"{type(model).__name__}; wrap it, e.g. nn.Sequential(embed, *layers, head)"
        )
    blocks = list(model.named_children())
    empty = [j for j, (a, b) in enumerate(pipeline.stages) if a >= b]
    if empty:
        raise HetrainError(
            f"the plan's pipeline stage {empty[0]} ({pipeline.stages[empty[0]]}) holds no block: each stage holds "
            f"[first, last) with first < last; re-plan (`hetrain plan --strategy pipeline`) or give it a block")
    ends = [b for _, b in pipeline.stages]
    starts = [a for a, _ in pipeline.stages]
    if starts[0] != 0 or ends[-1] != len(blocks) or any(a != b for a, b in zip(starts[1:], ends[:-1])) \
            or any(a >= b for a, b in pipeline.stages):
        raise HetrainError(
            f"the plan's pipeline stages {pipeline.stages} do not cover the model's {len(blocks)} blocks in order; "
            "re-plan with the profile of this model (`hetrain profile` then `hetrain plan`)"
        )
    return blocks


def rank_stages(pipeline: PipelinePlan, position: int) -> list[int]:
    """The pipeline stages the rank at `position` (its plan entry's `stage`) holds: one, or one per chunk."""
    p = pipeline.ranks_per_pipeline
    return [position + c * p for c in range(pipeline.chunks)]


class StageBlocks(nn.Sequential):
    """A stage's blocks under their original names, run as the model's nn.Sequential runs them: each block takes
    the previous block's output as its one argument (a tuple as one tuple). torch's stage passes the previous
    stage's outputs (a tuple a block returned) as separate arguments: they go to the stage's first block as that
    one tuple. The first stage's inputs are the script's: several ((ids, mask)) go one by one where the first
    block's forward takes them (forward(ids, mask), forward(x, mask=None)), else as one tuple."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], index: int, last: bool) -> None:
        super().__init__(OrderedDict(blocks))
        self.index, self.last = index, last
        self._spreads: dict[int, bool] = {}   # by the number of inputs: whether the first block takes them apart

    def _spread(self, count: int) -> bool:
        if count not in self._spreads:
            try:
                first = getattr(self[0], "_orig_mod", self[0])   # a compiled block: its module's forward
                inspect.signature(first.forward).bind(*[None] * count)
                self._spreads[count] = self.index == 0
            except (TypeError, ValueError):
                self._spreads[count] = False
        return self._spreads[count]

    def forward(self, *args: Any) -> Any:
        blocks = iter(self)
        x = next(blocks)(*args) if len(args) == 1 or self._spread(len(args)) else next(blocks)(args)
        for block in blocks:
            x = block(x)
        if not self.last and not (isinstance(x, torch.Tensor) or (
                isinstance(x, (tuple, list)) and len(x) > 1 and all(isinstance(t, torch.Tensor) for t in x))):
            what = f"a {type(x).__name__} of {len(x)}" if isinstance(x, (tuple, list)) else type(x).__name__
            raise HetrainError(
                f"pipeline stage {self.index} ends in a block that returns {what}: a stage passes the next a tensor "
                "or a tuple of two or more tensors (no None, nesting or one-tensor tuple, which it cannot tell from "
                "the tensor); return that from the block, or re-plan the stages to end at another block")
        return x


def stage_modules(model: nn.Module, pipeline: PipelinePlan, position: int) -> list[StageBlocks]:
    """Each stage's blocks the rank at `position` holds, as a StageBlocks (an nn.Sequential) under their
    original names (the model's own modules)."""
    blocks = model_blocks(model, pipeline)
    return [StageBlocks(blocks[slice(*pipeline.stages[s])], s, s == len(pipeline.stages) - 1)
            for s in rank_stages(pipeline, position)]


def handoff_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a stage's 16-bit outputs are widened to: fp32, as the planner prices a hand-off, or float64 where
    all the stage's weights are double (autocast never narrows double: a 16-bit output came from fp32 work). fp32 and float64 outputs travel as they are, as in the model's own
    nn.Sequential: a double output cast to fp32 met the next stage's double weights ("mixed dtype"), and an fp32
    model's output widened to double for a double buffer of its stage met the next stage's fp32 weights."""
    floating = [p for p in module.parameters() if p.is_floating_point()]
    return torch.float64 if floating and all(p.dtype == torch.float64 for p in floating) else torch.float32


def compute_in_precision(module: nn.Module, autocast: Callable[[], ContextManager]) -> None:
    """The stage's forward under its rank's autocast (its backward outside it, as torch advises), and its
    16-bit outputs widened (`handoff_dtype`; fp32 and float64 outputs are left as they are), so stages of
    different precisions exchange the dtype the model computes in. torch's stage learns the dtypes it receives, and those of the
    gradients it sends back, from a forward through these hooks."""
    active: list[ContextManager] = []
    wide = handoff_dtype(module)

    def enter(_module: nn.Module, _args: object) -> None:
        ctx = autocast()
        ctx.__enter__()
        active.append(ctx)

    def widen(t: object) -> object:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.element_size() >= 4:
            return t
        return t.to(wide)

    def leave(_module: nn.Module, _args: object, output: object) -> object:
        active.pop().__exit__(None, None, None)
        if not isinstance(output, (tuple, list)):
            return widen(output)
        cast = [widen(t) for t in output]
        return type(output)(*cast) if hasattr(output, "_fields") else type(output)(cast)   # a namedtuple too

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def check_pipeline_plan(plan: Plan) -> None:
    """A plan with pipeline stages needs the partition that says which blocks each stage holds."""
    if plan.pipeline is None and (plan.strategy in PIPELINE_STRATEGIES or any(r.stage for r in plan.ranks)):
        raise HetrainError(
            f"the plan (strategy {plan.strategy}) gives ranks pipeline stages but no pipeline partition "
            "(pipeline.stages); re-plan with `hetrain plan --strategy pipeline`, or remove the stages"
        )
    if plan.pipeline is not None and plan.sharding not in ("none", "fsdp"):
        raise HetrainError(
            f"the plan shards ({plan.sharding!r}) inside pipeline stages, where hetrain runs FSDP2 only; set "
            "\"sharding\" to \"fsdp\" or \"none\" in the plan, or re-plan with `hetrain plan --strategy pipeline`"
        )
    if plan.pipeline is not None:
        pipeline_layout(plan.ranks, plan.pipeline, plan.ranks[0].rank)   # every stage has its ranks


def tied_parameters(model: nn.Module, pipeline: PipelinePlan) -> list[tuple[tuple[int, ...], nn.Parameter]]:
    """Parameters that the ranks of several stages hold (tied input and output embeddings), with
    those ranks' positions in the pipeline, in the model's order (the same on every rank)."""
    blocks = model_blocks(model, pipeline)
    holders: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, (a, b) in enumerate(pipeline.stages):
        j = s % pipeline.ranks_per_pipeline
        for _, block in blocks[a:b]:
            for p in block.parameters():
                stages = holders.setdefault(id(p), [])
                if j not in stages:
                    stages.append(j)
                params[id(p)] = p
    return [(tuple(h), params[i]) for i, h in holders.items() if len(h) > 1]
