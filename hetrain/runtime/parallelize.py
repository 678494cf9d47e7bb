"""The plan applied to a model, in a fixed order: activation checkpointing, then FSDP2 or DDP with
its comm hook, then ZeRO-1 on the optimizer. Each part is a function of (model, plan entry, ...)
that can be called and tested alone; `parallelize` composes them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hetrain.errors import HetrainError
from hetrain.planning.plan import CommPlan, RankPlan
from hetrain.runtime import memory, sharding
from hetrain.runtime.buffers import buffer_places, keep_buffers_without_samples, sync_buffers
from hetrain.runtime.cross_rank import GATHER_NODE
from hetrain.runtime.kept_outputs import KeptOutputs, zeros_through
from hetrain.runtime.plain_backward import PlainBackwards, session_backward
from hetrain.runtime.precision import watch_precision
from hetrain.runtime.replicas import copy_from, module_tensors
from hetrain.runtime.step_guard import stepped_parameters
from hetrain.runtime.timing import StepTimer, TimedHookState, timed_hook
from hetrain.runtime.user_parallel import check_bare_model, refuse_outer_wrapper
from hetrain.vocabulary import ZERO1_SHARDINGS

log = logging.getLogger("hetrain")

# rank 0's buffers are copied once a step, after backward (hetrain.runtime.buffers), not by DDP in each forward
_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                           else {"broadcast_buffers": False})


@dataclass
class Prepared:
    """What `parallelize` returns: the wrapped model, the (maybe sharded) optimizer, the blocks."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    blocks: list[nn.Module]
    comm_state: Any = None      # the comm hook's state (its `stats` count bytes), when one is set
    ddp_reduces: frozenset[int] = frozenset()   # ids of the parameters DDP's buckets reduce (trainable at prepare)
    late_trainable_said: bool = False
    find_unused: bool = False   # DDP's find_unused_parameters
    sync_batchnorm: bool = False   # SyncBatchNorm's backward all-reduces: a backward must go through it
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = field(default_factory=list)   # where, and as at prepare()
    kept: KeptOutputs | None = None   # find_unused: the last training forward's outputs (hetrain.runtime.kept_outputs)
    plain: PlainBackwards | None = None   # replicated: the script's own backwards in a step (plain_backward.py)
    handles: list[Any] = field(default_factory=list)   # hooks on the script's own model, removed at release()
    half: list[tuple[str, nn.Parameter]] = field(default_factory=list)   # frozen in half precision at prepare()

    def backward(self, loss: torch.Tensor, first_of_step: bool, last_of_step: bool = True) -> None:
        """The session's backward of `loss` (weighted, scaled); then the outputs kept for one without items go."""
        unfrozen = next((name for name, p in self.half if p.requires_grad), None)
        if unfrozen is not None:   # refused before FSDP2's reduce-scatter fails on it, or DDP leaves it unreduced
            raise HetrainError(half_trainable(unfrozen, next(p.dtype for n, p in self.half if n == unfrozen)))
        if self.plain is not None:
            self.plain.before_backward(first_of_step)
        with session_backward(self.plain):
            try:
                loss.backward()
            except NotImplementedError as e:   # DDP's buckets read a sparse gradient (F.embedding(sparse=True))
                if "Sparse" not in str(e):
                    raise
                raise HetrainError(f"a sparse gradient reached the step ({e}): {SPARSE_FIX}") from e
        if self.plain is not None:
            self.plain.after_backward(last_of_step)
        if self.kept is not None:
            self.kept.drop()

    def check_pieces(self) -> None:
        """Refuses a write to the model between a step's micro-batches (plain_backward.py)."""
        if self.plain is not None:
            self.plain.check_pieces()

    def before_step(self) -> None:
        """Refuses a step whose gradients a backward of the script's own joined after session.backward()."""
        if self.plain is not None:
            self.plain.before_step()

    def release(self) -> None:
        """The session closed: the hooks it put on the user's model and parameters go."""
        if self.plain is not None:
            self.plain.remove()
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def module(self) -> nn.Module:
        """The user's model inside its wrapper."""
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    @property
    def state_module(self) -> nn.Module:
        """The user's model as its state dict names it: under `torch.compile(model)` the module compiled (its
        keys without `_orig_mod.`, so a checkpoint or an export loads into the plain model, compiled or not)."""
        return uncompiled(self.module)

    def sync_buffers(self, src: int = 0) -> None:
        """Rank `src`'s buffers on every rank (collective; hetrain.runtime.buffers)."""
        sync_buffers(self.buffers, src)

    @functools.cached_property
    def parameters(self) -> tuple[nn.Parameter, ...]:
        """The model's parameters, listed once: every step reads their gradients."""
        return tuple(self.model.parameters())


def uncompiled(module: nn.Module) -> nn.Module:
    """The module `torch.compile` wrapped (its `_orig_mod`), else the module itself."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def check_optimizer(optimizer: Any) -> None:
    """One torch optimizer whose step needs no closure: what `session.step()` can step once a step."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise HetrainError(
            f"session.prepare() takes one torch.optim.Optimizer, got {type(optimizer).__name__}: a session trains "
            "one model with one optimizer; put several models in one module (nn.ModuleDict({'a': a, 'b': b})) and "
            "their parameters in one optimizer's groups (torch.optim.Adam([{'params': a.parameters()}, {'params': "
            "b.parameters(), 'lr': 1e-4}])), or give each model a session of its own (docs/porting.md)")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise HetrainError(
            f"{type(optimizer).__name__}.step() needs a closure that evaluates the model again, and session.step() "
            "applies one update from the global batch's gradient with none; use an optimizer that steps "
            "without one (SGD, Adam, AdamW, ...)")


def check_optimizer_holds_the_model(optimizer: Any, model: nn.Module) -> None:
    """The optimizer steps the model's parameters only: another tensor's gradient (a learnable temperature held
    by the loss, a model built again after its optimizer) is neither all-reduced nor counted over the global
    batch, or never computed, and its step is silent."""
    if optimizer is None:
        return
    own = {id(p) for p in model.parameters()}
    stepped = stepped_parameters(optimizer)
    other = [p for p in stepped if id(p) not in own]
    if not other:
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in other[:3]) + (", ..." if len(other) > 3 else "")
    if len(other) == len(stepped):
        raise HetrainError(
            f"the optimizer holds none of the model's parameters (shapes {shapes}): it was built on another model "
            "object (a model made again after its optimizer); build the optimizer on the model passed to "
            "session.prepare()")
    if not any(p.requires_grad for p in other):   # another model's frozen weights: harmless now, not if unfrozen
        raise HetrainError(
            f"the optimizer holds {len(other)} frozen tensor(s) that are not the model's parameters (shapes "
            f"{shapes}), another model's (a distillation's teacher?): leave them out of the optimizer (build it on "
            "the model's parameters only); if they are to be trained, make them the model's")
    raise HetrainError(
        f"the optimizer holds {len(other)} tensor(s) that are not the model's parameters (shapes {shapes}): their "
        "gradients would be neither all-reduced nor counted over the global batch, so each rank would train its "
        "own copy; make them the model's (a learnable loss temperature as an attribute of the model)")


def check_parameters(model: nn.Module, sharding_name: str = "none") -> None:
    """Trainable parameters must be fp32 (or float64, complex) and real tensors: each rank computes in its
    precision under autocast, and the step counts, unscales and clips dense gradients. A frozen part may be
    half precision (a distillation's teacher held by the model): it has no gradient, master weight or state."""
    dtypes: dict[torch.dtype, str] = {}
    for name, p in model.named_parameters():
        if p.dtype in (torch.float16, torch.bfloat16) and p.requires_grad:
            raise HetrainError(half_trainable(name, p.dtype))
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise HetrainError(
                f"parameter {name} is not initialised yet (a lazy module's shape comes from its first input); run "
                "one forward on a sample batch before session.prepare(), so every rank holds the same weights")
        if p.is_meta:
            raise HetrainError(
                f"parameter {name} is on the meta device (it has no values); materialise the model before "
                "session.prepare(): model.to_empty(device='cpu'), then initialise its weights (every rank alike, "
                "from one seed, or load a checkpoint's)")
        if p.requires_grad:   # a frozen table in float64 is neither flattened nor stepped
            dtypes.setdefault(p.dtype, name)
    sparse = [n for n, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise HetrainError(f"{sparse[0] or 'the model'} makes sparse gradients (sparse=True): {SPARSE_FIX}")
    if len(dtypes) > 1 and sharding_name != "none":
        kinds = ", ".join(f"{str(d).removeprefix('torch.')} ({n})" for d, n in dtypes.items())
        raise HetrainError(
            f"sharding {sharding_name!r} needs the model's parameters in one dtype, and they are {kinds}: torch's "
            "ZeRO-1 and FSDP2 flatten them together; give them one dtype, or use sharding 'none'")


def half_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters in half precision (frozen: check_parameters refused trainable ones)."""
    return [(n, p) for n, p in model.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)]


def half_trainable(name: str, dtype: torch.dtype) -> str:
    return (f"parameter {name} is {str(dtype).removeprefix('torch.')} and trainable; hetrain keeps master weights "
            "and optimizer state in fp32 and computes in each rank's precision under session.autocast(); pass the "
            "model in fp32 (model.float()), or freeze that part (requires_grad_(False)) if it is not trained")


SPARSE_FIX = ("a step counts, unscales and clips dense gradients; build the embedding with sparse=False (or call "
              "F.embedding without sparse=True), and an optimizer for sparse gradients, such as SparseAdam, becomes Adam")


def sync_batchnorm(model: nn.Module, device: torch.device, world_size: int, warn: bool) -> nn.Module:
    """SyncBatchNorm on CUDA; on CPU ranks statistics stay local (with a warning)."""
    # torch's base of every BatchNorm kind, the class its convert_sync_batchnorm looks for
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not has_bn:
        return model
    if device.type != "cuda" and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        raise HetrainError("the model holds SyncBatchNorm, which runs on CUDA only, and this rank is a CPU rank: "
                           "leave out nn.SyncBatchNorm.convert_sync_batchnorm (hetrain converts BatchNorm on "
                           "CUDA ranks itself)")
    if world_size == 1:
        return model
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if warn:
        warnings.warn(
            "BatchNorm statistics stay local to each CPU rank (SyncBatchNorm needs CUDA); with uneven "
            "shares each rank normalises over its own share. Use GroupNorm/LayerNorm for exact results.",
            stacklevel=4,
        )
    return model


def apply_activation_checkpointing(model: nn.Module, entry: RankPlan,
                                   blocks: Sequence[nn.Module] | None = None) -> list[nn.Module]:
    """Checkpoint the blocks when the entry asks for it; returns the model's blocks either way."""
    if entry.activation_checkpointing:
        return memory.apply_activation_checkpointing(model, blocks)
    return memory.resolve_blocks(model, blocks)


def apply_ddp(model: nn.Module, device: torch.device, comm: CommPlan | None, timer: StepTimer,
              find_unused_parameters: bool = False) -> tuple[DistributedDataParallel, Any, Any]:
    """DistributedDataParallel with the plan's comm hook, timed (the last bucket ends the compute): (the model,
    the hook's state, the handle of the timer's hook on the script's own model)."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=comm.bucket_cap_mb if comm else 25.0,
        gradient_as_bucket_view=comm.gradient_as_bucket_view if comm else True,
        find_unused_parameters=find_unused_parameters,
        **_NO_FORWARD_BUFFER_SYNC,
    )
    if comm is not None and (comm.compression != "none" or comm.hierarchical):
        from hetrain.runtime.comm_hooks import build_comm_hook

        inner_state, inner_hook = build_comm_hook(comm)
        timed = TimedHookState(timer, inner_state, inner_hook)
    else:
        from hetrain.runtime.compression.stats import CommStats

        timed = inner_state = TimedHookState(timer, None, default_hooks.allreduce_hook, stats=CommStats())
    ddp.register_comm_hook(timed, timed_hook)
    timed_handle = timer.attach_ddp(ddp)

    def note_sync(module: DistributedDataParallel, args: Any) -> None:
        """Whether a training forward will have its gradients all-reduced (False inside `no_sync()`)."""
        if torch.is_grad_enabled():
            timed.forward_synced = module.require_backward_grad_sync

    ddp.register_forward_pre_hook(note_sync)
    refuse_outer_wrapper(ddp)   # a DDP of the script's around it would average the gradients a second time
    return ddp, inner_state, timed_handle


def apply_fsdp(model: nn.Module, blocks: Sequence[nn.Module], entry: RankPlan, device: torch.device,
               timer: StepTimer) -> nn.Module:
    """FSDP2 over each block, then the root; optimizer state offloaded when the entry says so (CUDA)."""
    offload = entry.offload_optimizer and device.type == "cuda"  # on a CPU rank state is in host memory
    copy_from(module_tensors(model), src=0)   # every rank shards rank 0's model, as DDP starts from it
    model = sharding.fully_shard_model(model, blocks, offload=offload)
    # every micro-batch gathers, reshards and reduce-scatters, the root too (FSDP2 keeps the root
    # gathered after forward unless told), so a rank holds only its shards between micro-batches
    model.set_reshard_after_forward(True)
    from hetrain.runtime.fsdp_waits import time_fsdp_collectives

    timer.comm_waits = time_fsdp_collectives(model, timer.speed)   # its waits in FSDP2's collectives: not compute
    model.register_forward_pre_hook(timer.outer_pre_hook, prepend=True)   # before FSDP2's all-gather
    model.register_forward_pre_hook(timer.forward_pre_hook)
    return model


def apply_zero1(optimizer: torch.optim.Optimizer, model: nn.Module, sharding_name: str,
                entries: Sequence[RankPlan], device: torch.device) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer: even, or by each rank's free memory (zero1-proportional)."""
    weights = None
    if sharding_name == "zero1-proportional":
        weights = sharding.free_memory_weights([e.memory_capacity_bytes for e in entries], model, device)
        log.info("optimizer state sharded by free memory: %s", ", ".join(f"{w / sum(weights):.3f}" for w in weights))
    from hetrain.runtime.zero1 import zero1_optimizer   # torch's ZeRO module, only for a ZeRO-1 plan

    return zero1_optimizer(optimizer, weights)


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, sharding_name: str,
                entries: Sequence[RankPlan], rank: int, comm: CommPlan | None, device: torch.device,
                timer: StepTimer, blocks: Sequence[nn.Module] | None = None,
                find_unused_parameters: bool = False, without_samples: Callable[[], bool] = lambda: False,
                in_step: Callable[[], bool] = lambda: True) -> Prepared:
    """The model on this rank's device with every choice of its plan entry applied, in order; a forward while
    `without_samples()` leaves the model's buffers as they were (hetrain.runtime.buffers)."""
    entry = entries[rank]
    check_optimizer(optimizer)
    check_bare_model(model)   # not parallelized by the script already (hetrain.runtime.user_parallel)
    check_parameters(model, sharding_name)
    check_optimizer_holds_the_model(optimizer, model)
    model = sync_batchnorm(model.to(device), device, len(entries), warn=rank == 0)
    chosen = apply_activation_checkpointing(model, entry, blocks)
    watch_precision(model, device, entry.precision, any(e.precision == "fp16" for e in entries))
    if sharding_name == "fsdp":
        names = {id(p): n for n, p in model.named_parameters()}
        model = apply_fsdp(model, chosen, entry, device, timer)
        keep_buffers_without_samples(model, without_samples)
        if optimizer is not None:
            optimizer = sharding.rebuild_optimizer(optimizer, names, model)
        prepared = Prepared(model, optimizer, chosen, buffers=buffer_places(model), half=half_parameters(model))
        keep_outputs(prepared, model, on_own_model=True, in_step=in_step)   # a rank without items: zeros through them
        prepared.plain = PlainBackwards(model, [p for p in model.parameters() if p.requires_grad])   # between pieces
        return prepared
    if entry.offload_optimizer and device.type == "cuda":
        raise HetrainError(
            f"rank {rank} asks for offload_optimizer with sharding {sharding_name!r}; optimizer state is "
            "offloaded through FSDP2's CPUOffloadPolicy: set the plan's sharding to 'fsdp'"
        )
    if sharding_name not in ZERO1_SHARDINGS:   # ZeRO-1 takes this rank's part of it to the device itself
        sharding.state_where_parameters_are(optimizer)
    ddp, comm_state, timed_handle = apply_ddp(model, device, comm, timer, find_unused_parameters)
    buffers = buffer_places(model)
    sync_buffers(buffers)   # DDP copied rank 0's parameters (a lazy module is refused there); buffers here, each step
    keep_buffers_without_samples(ddp, without_samples)   # on the wrapper: the user's model still pickles
    if optimizer is not None and sharding_name in ZERO1_SHARDINGS:
        optimizer = apply_zero1(optimizer, model, sharding_name, entries, device)
    prepared = Prepared(ddp, optimizer, chosen, comm_state,
                        frozenset(id(p) for p in model.parameters() if p.requires_grad),
                        find_unused=find_unused_parameters,
                        sync_batchnorm=any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()), buffers=buffers,
                        half=half_parameters(model))
    prepared.handles.append(timed_handle)   # on the script's own model: gone when the session closes
    if optimizer is not None and sharding_name in ZERO1_SHARDINGS:   # its broadcast's wait is not optimizer time
        prepared.handles.extend(timer.time_local_steps(optimizer.optim))
    prepared.plain = PlainBackwards(ddp, [p for p in model.parameters() if p.requires_grad])
    if find_unused_parameters or prepared.sync_batchnorm:   # the outputs held from a training forward until the
        keep_outputs(prepared, ddp)                           # next one begins
    return prepared


def keep_outputs(prepared: Prepared, module: nn.Module, on_own_model: bool = False,
                 in_step: Callable[[], bool] = lambda: True) -> None:
    """Hold each training forward's outputs until the next (hetrain.runtime.kept_outputs): a backward without items
    sends its zeros through them. Hooks on the script's own model (FSDP2's) go when the session closes; there
    every forward's outputs are kept until the backward, of forwards inside a step only (`in_step`): an evaluation
    between steps run with gradients on would otherwise hold each batch's graph until the next backward."""
    prepared.kept = KeptOutputs(every_forward=on_own_model, in_step=in_step)
    handles = [module.register_forward_pre_hook(prepared.kept.clear), module.register_forward_hook(prepared.kept.note)]
    if on_own_model:
        prepared.handles.extend(handles)


THROUGH_NOT_FINITE = (
    "this rank's loss counts no items and is not finite (a mean over a fully masked batch, 0/0), and it went through "
    "another session's model (a GAN's generator loss through its discriminator), whose all-reduce this backward "
    "must join on every rank: make the loss finite where it counts nothing, e.g. divide by count.clamp(min=1)")


def graph_zeros(prepared: Prepared, loss: torch.Tensor, others: set[int] = frozenset(), empty: bool = False) -> torch.Tensor:
    """A backward without items that must still run through the forward's graph (FSDP2's reduce-scatter,
    SyncBatchNorm's backward all-reduce): zeros through the outputs the loss took, not through the loss itself,
    whose own backward a hand-made mean over no items (0/0) makes NaN; the loss where no output was kept. Beside
    a companion session's model (`others`: its parameters' ids), which the loss may have gone through frozen or
    not (a GAN's generator loss through its discriminator, whose gathers and reduce-scatters run in this backward
    on the ranks with items), the loss's own graph, times 0, where this rank has no samples (`empty`: no NaN
    reaches a weight through its empty tensors). Not where it has samples and counts no items: a finite loss
    can still send NaN backward (torch.where over 0/0), and whether it went through the other model cannot be
    told (a frozen model's parameters are not in its graph, FSDP2's gathered ones are not those prepared)."""
    if others and empty:
        return torch.nan_to_num(loss.float()) * 0.0
    zeros = prepared.kept.zeros(loss) if prepared.kept is not None else None
    return zeros if zeros is not None else torch.nan_to_num(loss.float()) * 0.0


def exact_zeros(prepared: Prepared, loss: torch.Tensor, others: set[int] = frozenset(), empty: bool = False) -> torch.Tensor:
    """What a backward without items runs: exact zeros for every trainable parameter (every rank joins every
    bucket's all-reduce), or under find_unused_parameters for those the loss reaches only (DDP marked the
    others ready after the forward; a gradient for them stopped it, 'marked ready twice'). Not the loss
    times 0: a token mean over no tokens is 0/0, and its backward NaN. But where the loss reaches parameters of
    a companion session's model (`others`, their ids: a GAN generator's loss through its discriminator), that
    model's DDP all-reduces in this backward on the ranks with items, before this one's: this rank runs the
    loss's own graph too, joining both in turn, where no NaN reaches a weight through it (the loss is finite,
    or the rank has no samples, `empty`, and its tensors are empty); else it is refused, naming the fix."""
    if holds_node(loss, GATHER_NODE):   # session.gather_rows: its backward is a collective every rank joins
        return torch.nan_to_num(loss.float()) * 0.0  # (a rank without rows: its tensors are empty, no NaN reaches a weight)
    if others and not others.isdisjoint(reachable_parameters(loss)):
        if not empty and not bool(torch.isfinite(loss.detach()).all()):
            raise HetrainError(THROUGH_NOT_FINITE)
        return torch.nan_to_num(loss.float()) * 0.0
    params = [p for p in prepared.parameters if p.requires_grad]
    if prepared.find_unused:
        zeros = prepared.kept.zeros(loss) if prepared.kept is not None else None
        if zeros is not None:   # through the outputs the loss took (hetrain.runtime.kept_outputs)
            return zeros
        reached = reachable_parameters(loss)
        params = [p for p in params if id(p) in reached]
    return zeros_through(params, loss)


def reachable_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors the loss's autograd graph reaches (as DDP's search for unused parameters): its
    AccumulateGrad nodes' variables."""
    return {id(fn.variable) for fn in graph_nodes(loss) if getattr(fn, "variable", None) is not None}


def graph_nodes(loss: torch.Tensor) -> Iterator[Any]:
    """Each node of the loss's autograd graph, once."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        yield fn
        todo.extend(next_fn for next_fn, _ in fn.next_functions)


def holds_node(loss: torch.Tensor, name: str) -> bool:
    """Whether the loss's autograd graph holds a node of this name."""
    return any(fn.name() == name for fn in graph_nodes(loss))


def reduce_late_trainable(prepared: Prepared) -> None:
    """All-reduce the gradients of parameters made trainable after prepare() (a backbone unfrozen mid-run):
    DDP's buckets hold the parameters trainable when it was built, and the others' gradients stayed each
    rank's own (the ranks' copies parted, 0.03 apart in 5 steps). Averaged as DDP averages, before the
    step's gradients are finished; a parameter no rank gave a gradient keeps none (the optimizer skips it,
    as one process would). Every rank must unfreeze the same parameters at the same step."""
    late = [p for p in prepared.parameters if p.requires_grad and id(p) not in prepared.ddp_reduces]
    if not late or not isinstance(prepared.model, DistributedDataParallel):
        return
    if not prepared.late_trainable_said:
        prepared.late_trainable_said = True
        log.info("%d parameter(s) became trainable after session.prepare(): their gradients are all-reduced after "
                 "backward each step, outside DDP's buckets", len(late))
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in late:   # one all-reduce per real dtype (a complex gradient travels as its real view)
        groups.setdefault(torch.view_as_real(p.detach()).dtype if p.is_complex() else p.dtype, []).append(p)
    world = torch.distributed.get_world_size()
    for dtype, params in groups.items():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if any(g.is_sparse for g in grads):   # an embedding made trainable after prepare() (checked there when trainable)
            raise HetrainError(f"a parameter made trainable after session.prepare() has a sparse gradient: {SPARSE_FIX}")
        flats = [(torch.view_as_real(g) if g.is_complex() else g).reshape(-1) for g in grads]
        given = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=flats[0].device)
        flat = torch.cat([*flats, given])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, part, seen in zip(params, flats, flat[-len(params):].tolist()):
            mean = flat[offset:offset + part.numel()] / world
            offset += part.numel()
            p.grad = None if seen == 0 else (torch.view_as_complex(mean.view(*p.shape, 2)) if p.is_complex()
                                             else mean.view_as(p))


def equal_piece_counts(model: nn.Module, sharding_name: str, layout: Any) -> bool:
    """Whether every rank runs the job's count of micro-batches a step: data-parallel FSDP2 and SyncBatchNorm
    run collectives in every forward (a rank with fewer pieces than another would pair its gradient
    all-reduce with the other's statistics). A rank short of pieces runs its own, then stand-ins (its first
    two samples, 0 items)."""
    return layout is None and (sharding_name == "fsdp" or any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()))


def gradient_sync(prepared: Prepared, sharding_name: str, sync: bool):
    """DDP's no_sync for all but a step's last micro-batch.

    FSDP2 gathers, reshards and reduce-scatters in every micro-batch, so a rank holds only its
    shards and one block's gathered parameters and gradients at a time (what ZeRO-3 is for); every
    rank runs the same number of micro-batches (the loader's `same_piece_count`), so every rank
    issues the same collectives.
    """
    import contextlib

    if sharding_name == "fsdp":   # set for every micro-batch once, in apply_fsdp
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else prepared.model.no_sync()
