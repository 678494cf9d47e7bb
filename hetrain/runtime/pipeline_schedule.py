"""One rank's stages of a pipeline, run by torch.distributed.pipelining's schedules (GPipe, 1F1B, and
interleaved 1F1B, where a rank holds one stage per chunk: `ScheduleInterleaved1F1B`).

Exact gradients (DESIGN.md invariant 1). The user's `loss_fn(output, target)` is a mean over a
micro-batch's items; the schedule runs backward of that mean times `items / estimate` (and the
job-wide loss scale), so a stage's gradient is `sum(items_i * grad_i) / estimate` over its
micro-batches. The same stage of every replica sums its gradients (all-reduce in the stage's
process group), and `hetrain.runtime.gradients.finish_gradients` divides by the true global item
count, which only last stages report. Replicas with unequal shares therefore stay exact.

Each rank computes its stage under its own precision's autocast; its 16-bit outputs are widened to fp32 (float64
where the stage's weights are double: `hetrain.runtime.pipeline_stages.handoff_dtype`), others travel as they are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from hetrain.errors import HetrainError
from hetrain.planning.plan import PipelinePlan
from hetrain.runtime.batch_tree import tensors
from hetrain.runtime.buffers import buffer_places, restore_buffers, snapshot_buffers, sync_buffers
from hetrain.runtime.environment import collective_timeout
from hetrain.runtime.gradients import agree_items_per_sample, local_tensor
from hetrain.runtime.kept_outputs import zeros_through
from hetrain.runtime.parallelize import Prepared
from hetrain.runtime.pipeline_batch import gather_replica_batch
from hetrain.planning.partition import microbatches_for
from hetrain.runtime.pipeline_stages import PipelineLayout, compute_in_precision, rank_stages, stage_modules
from hetrain.runtime.pipeline_timing import StageClock
from hetrain.runtime.precision import JobLossScaler
from hetrain.runtime.replicas import module_tensors, receive_from, send_to
from hetrain.runtime.sharding import carry_state, state_where_parameters_are
from hetrain.runtime.step_guard import warn_if_evaluating
from hetrain.runtime.step_state import StepState, items_as_number

if TYPE_CHECKING:   # FSDP2's timed collectives are imported where a stage is sharded, not with every session
    from hetrain.runtime.fsdp_waits import CommWaits

log = logging.getLogger("hetrain")

MULTI_STAGE = ("interleaved-1f1b",)   # schedules that take a list of this rank's stages


def schedule_class(name: str) -> type:
    """torch's schedule for a plan's schedule name. torch.distributed.pipelining is imported here, when
    a pipeline plan runs, not with every session: it adds half a second to each rank's start-up."""
    from torch.distributed import pipelining

    return {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
            "interleaved-1f1b": pipelining.ScheduleInterleaved1F1B}[name]


def make_groups(layout: PipelineLayout) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(this replica's pipeline group, this stage's replica group or None with one replica); every
    rank creates every group, in the same order, as torch requires."""
    pipe_group = stage_group = None
    for row in layout.grid:
        g = dist.new_group(ranks=row, timeout=collective_timeout())   # the job's, not gloo's 30 min
        if row is layout.replica_ranks():
            pipe_group = g
    if layout.replicas > 1:
        for j in range(layout.stages):
            ranks = layout.stage_ranks(j)
            g = dist.new_group(ranks=ranks, timeout=collective_timeout())
            if j == layout.stage:
                stage_group = g
    return pipe_group, stage_group


def item_counter(num_items: Any) -> Callable[[Any], float]:
    """How many items a micro-batch's target holds: `num_items(target)`, or its samples."""
    if num_items is None:
        return lambda target: float(_first_tensor(target).shape[0])
    if callable(num_items):
        return lambda target: items_as_number(num_items(target))
    raise HetrainError(
        f"num_items={num_items!r}: a pipeline cuts the batch into micro-batches, so pass a function of the "
        "target that counts its items, e.g. num_items=lambda labels: (labels != -100).sum()"
    )


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise HetrainError(f"a pipeline's target must be a tensor (or a tuple of tensors), got {type(value).__name__}")


SCHEDULES_KEPT = 8
"""Schedules (and their stages' transfer buffers) kept for the micro-batch shapes seen last."""


class PipelineRunner:
    """This rank's pipeline stages (one per chunk), their schedule and the groups they talk to."""

    def __init__(self, module: nn.Module, layout: PipelineLayout, pipeline: PipelinePlan, device: torch.device,
                 autocast: Callable[[], ContextManager], ties: list[tuple[tuple[int, ...], nn.Parameter]] | None = None, speed: float | None = None,
                 sharded: bool = False, chunks: list[nn.Module] | None = None, comm_waits: CommWaits | None = None) -> None:
        self.module = module   # every block this rank holds (its chunks' blocks)
        self.layout = layout
        self.pipeline = pipeline
        self.device = device
        self.pipe_group, self.stage_group = make_groups(layout)
        self.sharded = sharded
        held = {id(p) for p in module.parameters()}
        self.ties = [(stages, p) for stages, p in (ties or []) if id(p) in held]
        self.tie_groups = make_tie_groups(layout, ties or [])
        self.autocast = autocast
        self.chunks = chunks or [module]
        for chunk in self.chunks:
            compute_in_precision(chunk, autocast)
        self.clock = StageClock(speed, comm_waits)   # this step's forward and backward compute
        self.inferring_shapes = False   # in torch's shape inference, whose forward is not the step's work
        self.step_samples = 0     # the samples of the last replica batch this stage ran (its ranks' slices)
        self.buffers = buffer_places(module) if self.stage_group is not None else []   # synced over the replicas
        self.buffer_source = layout.stage_ranks()[0]   # the step's first replica with samples: its stage's rank
        self._schedules: dict[tuple, Any] = {}   # by micro-batch count and shapes, most recent last
        self._loss: Callable | None = None
        self._running = False
        self._told: set[int] = set()   # micro-batch counts other than the plan's, said once each
        for held in {id(m): m for m in [module, *self.chunks]}.values():
            held.register_forward_pre_hook(self._refuse_direct_call)

    def _refuse_direct_call(self, module: nn.Module, args: Any) -> None:
        """A stage holds some blocks only: the script's own `model(x)` would feed them the batch."""
        if not self._running:
            raise HetrainError("under a pipeline plan this rank holds some of the model's blocks only, so "
                               "model(inputs) cannot run here: run each step with "
                               "session.forward_backward(inputs, target, loss_fn), evaluate with "
                               "session.evaluate(inputs, target, loss_fn), and save with "
                               "session.model_state_dict() (docs/pipeline.md)")

    def take_busy_seconds(self) -> float:
        """This step's compute seconds so far, and start counting the next step's."""
        return self.clock.take()

    def carries_samples(self) -> bool:
        """Whether the forward now running is the step's work (for the model FLOPs): torch's shape inference,
        a forward of its own on a new schedule's first step, is not."""
        return not self.inferring_shapes

    def microbatches(self, samples: int) -> int:
        m = microbatches_for(samples, self.pipeline.microbatches,
                             self.layout.stages if self.pipeline.schedule in MULTI_STAGE else None)
        if m != self.pipeline.microbatches and m not in self._told and dist.get_rank() == 0:
            self._told.add(m)
            log.info("pipeline: a replica batch of %d samples runs in %d micro-batches, not the plan's %d "
                     "(every micro-batch has one shape%s)", samples, m, self.pipeline.microbatches,
                     ", in rounds of the ranks" if self.pipeline.schedule in MULTI_STAGE else "")
        return m

    def _stages(self) -> list[Any]:
        """This rank's torch PipelineStages, one per chunk. A stage learns the shapes it exchanges on its
        first step, so each micro-batch shape has stages of its own (`_schedule`)."""
        from torch.distributed.pipelining import PipelineStage

        stages = [PipelineStage(chunk, index, len(self.pipeline.stages), self.device, group=self.pipe_group)
                  for chunk, index in zip(self.chunks, rank_stages(self.pipeline, self.layout.stage))]
        if len(stages) == 1:
            # Stage j's peer is the replica's stage-j rank, whatever its place in the group's (sorted) order
            # (multi-stage schedules map stage s to group rank s % p themselves: the layout keeps ranks in order).
            stages[0].stage_index_to_group_rank = {j: dist.get_group_rank(self.pipe_group, r)
                                                   for j, r in enumerate(self.layout.replica_ranks())}
        for stage in stages:
            for name in SHAPE_INFERENCE:
                if hasattr(stage, name):
                    setattr(stage, name, self._inferring(keeping_buffers(getattr(stage, name), stage.submod)))
            stage.forward_one_chunk = self.clock.timed(stage.forward_one_chunk)
            stage.backward_one_chunk = self.clock.timed(stage.backward_one_chunk)
        return stages

    def _inferring(self, work: Callable) -> Callable:
        """torch's shape inference, flagged while it runs: its forward counts no model FLOPs."""

        def inferring(*args: Any, **kwargs: Any) -> Any:
            self.inferring_shapes = True
            try:
                return work(*args, **kwargs)
            finally:
                self.inferring_shapes = False

        return inferring

    def _schedule(self, m: int, batch: Any) -> Any:
        """The schedule of `m` micro-batches of this batch's shapes (every rank of a replica holds the
        replica's batch, so all of them see a new shape at the same step). The last few are kept."""
        key = (m,) + tuple((t.shape[0] // m, tuple(t.shape[1:]), t.dtype) for t in tensors(batch))
        if key not in self._schedules:
            if len(self._schedules) >= SCHEDULES_KEPT:
                del self._schedules[next(iter(self._schedules))]
            name = self.pipeline.schedule
            if name == "1f1b" and m < self.layout.stages:
                name = "gpipe"   # torch's 1F1B needs a micro-batch per stage; GPipe's update is the same
            stages = self._stages()
            self._schedules[key] = schedule_class(name)(stages if name in MULTI_STAGE else stages[0],
                                                        n_microbatches=m, loss_fn=self._call_loss, scale_grads=False)
        self._schedules[key] = self._schedules.pop(key)   # most recent last
        return self._schedules[key]

    def _call_loss(self, output: Any, target: Any) -> torch.Tensor:
        return self._loss(output, target)

    def gather_batch(self, batch: Any) -> Any:
        """The replica's (inputs, target) from the slices its ranks' loaders read (all-gather in the replica, in
        rank order). The first stage takes positional inputs: a dict of them is refused."""
        if isinstance(batch[0], Mapping):
            raise HetrainError(
                "a dict of inputs under a pipeline plan: a stage passes tensors to the next, and the first takes "
                "positional inputs; pass them as a tuple, e.g. (batch['input_ids'],) (docs/pipeline.md)")
        return gather_replica_batch(batch, self.pipe_group, self.device)

    def _samples(self, inputs: Any, target: Any) -> int:
        """The replica batch's samples, read from what this rank's stages hold (the target on the last)."""
        return _first_tensor(target if self.layout.is_last else _as_tuple(inputs)[0]).shape[0]

    def run(self, inputs: Any, target: Any, loss_fn: Callable, count: Callable[[Any], float], *, state: StepState,
            scaler: JobLossScaler) -> torch.Tensor | None:
        """Forward and backward of the replica batch through every stage; on last stages the mean loss."""
        warn_if_evaluating(self.module, "session.forward_backward()", blocks=True)
        self._running = True
        try:
            return self._run(inputs, target, loss_fn, count, state=state, scaler=scaler)
        finally:
            self._running = False

    def _run(self, inputs: Any, target: Any, loss_fn: Callable, count: Callable[[Any], float], *, state: StepState,
             scaler: JobLossScaler) -> torch.Tensor | None:
        samples = self.step_samples = self._samples(inputs, target)
        self.buffer_source = replica_with_samples(self.layout, state.split)
        if state.items_per_sample is None:   # the run's first step: every rank agrees on items per sample
            counted = (count(target), samples) if self.layout.is_last and samples else (0.0, 0)
            state.items_per_sample = agree_items_per_sample(*counted, self.device)
        if samples == 0:
            return None
        # FSDP2 averages a stage's gradients over its replicas: weigh by their number to keep the sum.
        estimate = state.estimate() / (self.layout.replicas if self.sharded else 1)
        calls: list[tuple[torch.Tensor, float]] = []

        def weighted(output: Any, tgt: Any) -> torch.Tensor:
            with self.autocast():
                value = loss_fn(output, tgt)
            n = count(tgt)
            calls.append((value.detach().to(torch.promote_types(value.dtype, torch.float32)), n))   # fp64 kept
            if n == 0:
                return output_zeros(output, value)
            return scaler.scale_loss(value * (n / estimate))

        self._loss = weighted
        m = self.microbatches(samples)
        schedule = self._schedule(m, (inputs, target))
        args = _as_tuple(inputs) if self.layout.is_first else ()
        if self.layout.is_last:
            schedule.step(*args, target=target, return_outputs=False)
        else:
            schedule.step(*args, return_outputs=False)
        self._loss = None
        if not self.layout.is_last:
            return None
        # The schedule's first step also calls the loss once on placeholder data to learn the
        # gradients' shapes; the micro-batches' losses are the last m calls.
        calls = calls[-m:]
        for value, n in calls:
            state.record_backward(value, n)
        items = sum(n for _, n in calls)
        if items == 0:
            return None
        return sum(value * n for value, n in calls if n > 0) / items

    def evaluate(self, inputs: Any, target: Any, loss_fn: Callable, count: Callable[[Any], float],
                 microbatches: int | None = None) -> tuple[float, float]:
        """Forward only of the replica batch through every stage (torch's schedule `eval`) in `microbatches` (the
        step's count by default): on last stages (sum of each micro-batch's mean loss times its items, items),
        elsewhere (0, 0). Not the step's compute."""
        samples = self._samples(inputs, target)
        if samples == 0:
            return 0.0, 0.0
        calls: list[tuple[float, float]] = []

        def loss(output: Any, tgt: Any) -> torch.Tensor:
            with self.autocast():
                value = loss_fn(output, tgt)
            calls.append((float(value.detach()), count(tgt)))
            return value

        m = microbatches or self.microbatches(samples)
        schedule = self._schedule(m, (inputs, target))
        args = _as_tuple(inputs) if self.layout.is_first else ()
        busy, self._loss, self._running = self.clock.busy_seconds, loss, True
        try:
            with torch.no_grad():
                schedule.eval(*args, **({"target": target} if self.layout.is_last else {}))
        finally:
            self.clock.busy_seconds, self._loss, self._running = busy, None, False
        calls = calls[-m:]
        return sum(v * n for v, n in calls if n > 0), float(sum(n for _, n in calls))

    def sync_gradients(self) -> None:
        """Sum the stage's gradients over its replicas (each is already weighted by its items), then
        tied parameters' gradients over the stages holding them; then copy the stage's buffers (BatchNorm's
        running statistics) from its first replica with samples in the step to the others, as data parallelism
        copies the first rank's with samples (hetrain.runtime.buffers): the replicas hold one model."""
        for p in self.module.parameters():
            if p.grad is None and p.requires_grad:   # a replica without samples still joins the sum
                p.grad = torch.zeros_like(p)
        if self.stage_group is not None and not self.sharded:   # FSDP2's reduce-scatter summed them already
            _sum_into([p.grad for p in self.module.parameters() if p.grad is not None], self.stage_group)
        for stages, group in self.tie_groups.items():   # a frozen tied weight has no gradient to sum
            _sum_into([p.grad for held_by, p in self.ties if held_by == stages and p.requires_grad], group)
        if self.buffers:
            sync_buffers(self.buffers, self.buffer_source, self.stage_group)

    def total_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the whole model's gradient (every stage), the same on every rank (collective): in fp32, or
        float64 where any stage's gradients are double (clipping a double model by an fp32 norm moved it 5e-9)."""
        counted_elsewhere = {id(p) for stages, p in self.ties if stages[0] != self.layout.stage}
        grads = [local_tensor(p.grad) for p in self.module.parameters()
                 if p.grad is not None and id(p) not in counted_elsewhere]
        local = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False) if grads else \
            torch.zeros((), device=self.device)
        double = float(any(g.dtype == torch.float64 for g in grads))   # summed (or maxed) with the norm: one call
        local = local.to(device=self.device, dtype=torch.float64)
        if math.isinf(norm_type):
            both = torch.stack([local, local.new_tensor(double)])
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        else:   # each stage's gradient is held whole by every replica (count it once), or in shards (count all)
            both = torch.stack([local ** norm_type / (1 if self.sharded else self.layout.replicas),
                                local.new_tensor(double)])
            dist.all_reduce(both)
            both[0] = both[0] ** (1.0 / norm_type)
        return both[0] if both[1] > 0 else both[0].float()


SHAPE_INFERENCE = ("_forward_metadata_inference", "_shape_inference")   # torch's, by version


def keeping_buffers(work: Callable, module: nn.Module) -> Callable:
    """torch's stage learns the shapes it exchanges from a forward of its own on its first step (of placeholder
    data past the first stage): the buffers that forward moved (BatchNorm's running statistics) go back as they
    were, so a resumed run, a new micro-batch shape and one process hold the same statistics."""

    def kept(*args: Any, **kwargs: Any) -> Any:
        snapshot = snapshot_buffers(module)
        try:
            return work(*args, **kwargs)
        finally:
            restore_buffers(snapshot)

    return kept


def replica_with_samples(layout: PipelineLayout, split: list[int] | None) -> int:
    """This stage's rank in the first replica whose ranks read samples in the step (`split`: every rank's)."""
    rows = [row for row in layout.grid if split is None or sum(split[r] for r in row) > 0] or layout.grid
    return rows[0][layout.stage]


def output_zeros(output: Any, loss: torch.Tensor) -> torch.Tensor:
    """What a last stage's micro-batch without items backpropagates: zeros through the stage's outputs the loss
    took, not through the loss, whose backward a hand-made mean over no items (0/0) makes NaN (as the
    data-parallel path, hetrain.runtime.kept_outputs); the loss times 0 where no output carries a gradient."""
    outs = [t for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    return zeros_through(outs, loss) if outs else torch.nan_to_num(loss) * 0.0


def _sum_into(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    if not grads:
        return
    grads = [local_tensor(g) for g in grads]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    parts = torch.split(flat, [g.numel() for g in grads])
    for g, part in zip(grads, parts):
        g.copy_(part.view_as(g))


def make_tie_groups(layout: PipelineLayout, ties: list[tuple[tuple[int, ...], nn.Parameter]]
                    ) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """Per set of stages sharing parameters, this replica's group of those stages' ranks (every rank
    creates every group in the same order)."""
    mine = {}
    for stages in sorted({s for s, _ in ties}):
        for replica, row in enumerate(layout.grid):
            g = dist.new_group(ranks=[row[j] for j in stages], timeout=collective_timeout())
            if replica == layout.replica and layout.stage in stages:
                mine[stages] = g
    return mine


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def call_model(model: nn.Module, inputs: Any) -> Any:
    """`model(*inputs)` for a tuple or list, `model(**inputs)` for a mapping (a tokenizer's BatchEncoding),
    else `model(inputs)`: how `forward_backward` calls a data-parallel model."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*_as_tuple(inputs))


def start_from_rank0(model: nn.Module, pipeline: PipelinePlan, layout: PipelineLayout, device: torch.device) -> None:
    """Every stage starts from rank 0's model, as DDP starts every rank from it, whatever each rank's seed:
    rank 0, which holds the whole model until it keeps its stages, sends every other rank its stages'
    weights (tied weights included)."""
    def tensors_at(position: int) -> list[torch.Tensor]:
        return module_tensors(nn.ModuleList(stage_modules(model, pipeline, position)))

    if dist.get_rank() != 0:
        receive_from(tensors_at(layout.stage), 0, device)
        return
    for row in layout.grid:
        for position, rank in enumerate(row):
            if rank != 0:
                send_to(tensors_at(position), rank, device)


def prepare_pipeline(model: nn.Module, optimizer: torch.optim.Optimizer | None, pipeline: PipelinePlan,
                     layout: PipelineLayout, device: torch.device,
                     activation_checkpointing: bool, autocast: Callable[[], ContextManager],
                     speed: float | None = None, sharded: bool = False) -> tuple[Prepared, PipelineRunner]:
    """This rank's stages of `model` on its device (one, or one per chunk), with their schedule; the
    user's optimizer keeps only these stages' parameters (in each of its groups, with the group's settings)."""
    from collections import OrderedDict

    from hetrain.runtime.memory import checkpoint_blocks
    from hetrain.runtime.parallelize import check_optimizer, check_optimizer_holds_the_model, check_parameters
    from hetrain.runtime.pipeline_stages import tied_parameters

    check_optimizer(optimizer)
    check_parameters(model)
    check_optimizer_holds_the_model(optimizer, model)
    start_from_rank0(model, pipeline, layout, device)
    ties = tied_parameters(model, pipeline)
    chunks = [chunk.to(device) for chunk in stage_modules(model, pipeline, layout.stage)]
    blocks = [block for chunk in chunks for block in chunk.children()]
    if activation_checkpointing:   # as under data parallelism: the blocks keep their names (and checkpoints)
        checkpoint_blocks(blocks)
    # One chunk is the rank's module; several are gathered in one (blocks under their own names) for the
    # optimizer, the checkpoint and the gradient sums.
    module = chunks[0] if len(chunks) == 1 else \
        nn.Sequential(OrderedDict(b for chunk in chunks for b in chunk.named_children()))
    if optimizer is not None:
        keep = {id(p) for p in module.parameters()}
        for group in optimizer.param_groups:   # the optimizer steps (and checkpoints) this stage's parameters
            group["params"] = [p for p in group["params"] if id(p) in keep]
        for p in [p for p in optimizer.state if id(p) not in keep]:   # loaded before prepare(): another stage's
            del optimizer.state[p]
    if layout.stages > 1:   # each stage draws its own dropout masks (one seed repeated a stage's masks in the next)
        torch.manual_seed(int(torch.randint(0, 2**62, ()).item()) + layout.stage)
    if sharded:
        from hetrain.runtime.fsdp_waits import time_fsdp_collectives
        from hetrain.runtime.pipeline_sharding import ShardedChunks, shard_stage

        names = {id(p): n for n, p in module.named_parameters()}
        shard_stage(chunks, layout, device)
        # its gathers' waits for the other replicas are not compute, and an emulated speed pads none of them
        comm_waits = time_fsdp_collectives(nn.ModuleList(chunks), speed)
        if len(chunks) > 1:
            module = ShardedChunks(chunks)
        by_name = dict(module.named_parameters())
        ties = [(stages, by_name[names[id(p)]] if id(p) in names else p) for stages, p in ties]
        if optimizer is not None:   # the same optimizer over the sharded parameters, its state cut as they are
            new_by_old = {id(p): by_name[names[id(p)]] for group in optimizer.param_groups for p in group["params"]}
            carry_state(optimizer, optimizer, new_by_old, names)
            for group in optimizer.param_groups:
                group["params"] = [new_by_old[id(p)] for p in group["params"]]
    else:
        comm_waits = None
        state_where_parameters_are(optimizer)
    runner = PipelineRunner(module, layout, pipeline, device, autocast, ties, speed, sharded, chunks, comm_waits)
    return Prepared(module, optimizer, blocks), runner
