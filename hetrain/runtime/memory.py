"""Memory per rank: activation checkpointing of a model's blocks, micro-batches, saved-activation bytes.

Activation checkpointing replaces a block's `forward` on the instance with a non-reentrant
`torch.utils.checkpoint` call of the original forward. No module is wrapped or renamed, so
parameter names, state dicts and sharded checkpoints are the same on ranks with and without it,
and hooks that others put on the block (FSDP2's unshard/reshard) still run around it.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetrain.errors import HetrainError
from hetrain.planning.batch_split import split_even
from hetrain.runtime.batch_tree import (cut_leaf, is_array, map_leaves, map_tensors, per_sample_lists,
                                         per_sample_values, sample_leaves, tensors)
from hetrain.runtime.buffers import restore_buffers, snapshot_buffers
from hetrain.runtime.gradients import local_tensor
from hetrain.workload.layers import find_blocks

log = logging.getLogger("hetrain")

_CHECKPOINTED = "_hetrain_checkpointed"


def resolve_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None) -> list[nn.Module]:
    """The blocks the user named, or the repeated blocks found in the model; checks they belong to it."""
    if blocks is None:
        return find_blocks(model)
    blocks = list(blocks)
    owned = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module) or id(block) not in owned:
            raise HetrainError(
                f"blocks[{i}] ({type(block).__name__}) is not a submodule of the model; pass "
                "session.prepare(model, optimizer, blocks=[...]) with modules taken from the model itself"
            )
    return blocks


def is_checkpointed(block: nn.Module) -> bool:
    """Whether the block recomputes its activations in backward."""
    return getattr(block, _CHECKPOINTED, False)


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> int:
    """Recompute each block's activations in backward (non-reentrant checkpoint); returns how many."""
    count = 0
    for block in blocks:
        if getattr(block, _CHECKPOINTED, False):
            continue
        inner = block.forward

        # only a block with buffers needs its recompute to see and leave them as the forward did; under
        # torch.compile, which takes no such context, the compiled recompute does not update them again
        contexts = functools.partial(_recompute_contexts, block) if any(True for _ in block.buffers()) else None

        def forward(*args: Any, _inner=inner, _contexts=contexts, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            if _contexts is None or torch.compiler.is_compiling():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        block.forward = forward
        setattr(block, _CHECKPOINTED, True)
        count += 1
    return count


def _recompute_contexts(block: nn.Module) -> tuple[Any, Any]:
    """(the forward's context, the recompute's): the recompute in backward runs the block's forward again with
    its buffers as the forward found them, and leaves them as the forward left them. BatchNorm's running
    statistics were otherwise updated twice (a count of 12 after 6 steps); a buffer the forward reads and
    writes (spectral_norm's power iteration, a model's own counter) gave a gradient of another forward. Every
    buffer is copied at every forward: which ones a forward writes can change between forwards (every second
    call, training mode only)."""
    found: list = []
    return _buffers_saved(block, found), _buffers_swapped(block, found)


@contextmanager
def _buffers_saved(block: nn.Module, found: list) -> Iterator[None]:
    found[:] = snapshot_buffers(block)
    yield


@contextmanager
def _buffers_swapped(block: nn.Module, found: list) -> Iterator[None]:
    after = snapshot_buffers(block)
    restore_buffers(found)
    try:
        yield
    finally:
        restore_buffers(after)


def apply_activation_checkpointing(model: nn.Module, blocks: Sequence[nn.Module] | None = None) -> list[nn.Module]:
    """Checkpoint the model's blocks (given, or found); a user error when there are none."""
    chosen = resolve_blocks(model, blocks)
    if not chosen:
        raise HetrainError(
            f"the plan asks for activation checkpointing but {type(model).__name__} has no nn.ModuleList or "
            "nn.Sequential of repeated blocks; pass them: session.prepare(model, optimizer, blocks=model.layers)"
        )
    checkpoint_blocks(chosen)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        # a Hugging Face model keeps a key/value cache in training forwards too: recomputing a block would
        # append its keys a second time (a shape error with an attention mask). Its own checkpointing turns
        # the cache off for training forwards; its config (saved with the weights) and generate() keep it.
        params = list(inspect.signature(model.forward).parameters.values())
        if any(p.name == "use_cache" for p in params):
            positional = [p.name for p in itertools.takewhile(lambda p: p.kind in (p.POSITIONAL_ONLY,
                                                                                   p.POSITIONAL_OR_KEYWORD), params)]
            at = positional.index("use_cache") if "use_cache" in positional else math.inf   # keyword-only: never
            model.register_forward_pre_hook(functools.partial(no_cache_in_training, at), with_kwargs=True)
        else:
            config.use_cache = False
            log.info("activation checkpointing: %s's config.use_cache set to False (a block recomputed in "
                     "backward would fill the key/value cache twice)", type(model).__name__)
    return chosen


def no_cache_in_training(position: float, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward pre-hook: a forward that computes gradients runs with `use_cache=False` unless it says
    (by name, or as positional argument `position`)."""
    if torch.is_grad_enabled() and "use_cache" not in kwargs and len(args) <= position:
        return args, {**kwargs, "use_cache": False}
    return None


# ---------------------------------------------------------------- micro-batches


def micro_batch_sizes(local_n: int, micro_batch: int | None, grad_accum: int = 1) -> list[int]:
    """Near-equal pieces of at most `micro_batch` samples (or `grad_accum` pieces); one empty piece for 0."""
    if local_n <= 0:
        return [0]
    pieces = math.ceil(local_n / micro_batch) if micro_batch else max(1, grad_accum)
    return split_even(local_n, min(pieces, local_n))


def equal_pieces(local_n: int, count: int, micro_batch: int | None = None, grad_accum: int = 1) -> list[int]:
    """`local_n` samples in exactly `count` pieces (FSDP2's collectives run once per micro-batch, so every rank
    runs the job's count): the rank's own micro-batches, then empty ones (stand-ins). Spread near-equally
    over the count, a rank's 2 samples became pieces of 1, which BatchNorm does not train on."""
    own = micro_batch_sizes(max(local_n, 0), micro_batch, grad_accum)
    if len(own) > count:
        return split_even(max(local_n, 0), count)
    return own + [0] * (count - len(own))


def job_piece_count(shares: Sequence[int], caps: Sequence[tuple[int | None, int]]) -> int:
    """The most micro-batches any rank's share needs under its plan entry's (micro_batch, grad_accum)."""
    return max(len(micro_batch_sizes(n, mb, accum)) for n, (mb, accum) in zip(shares, caps))


def slice_batch(batch: Any, start: int, stop: int, local_n: int) -> Any:
    """Samples [start, stop) of a collated batch: every tensor whose first dimension is `local_n`, and every
    list of one plain value, or one list of them, per sample (`cut_leaf`); anything else (a scalar, a [1, T] broadcast)
    is shared by all pieces. A [T, B, ...] tensor (sequence-first) cannot be cut and is refused."""
    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return cut_leaf(x, start, stop, local_n)
        if x.dim() > 0 and x.shape[0] == local_n:
            return x[start:stop]
        if local_n > 1 and x.dim() >= 2 and x.shape[0] != 1 and x.shape[1] == local_n:   # [T, B, ...]
            raise HetrainError(
                f"a batch tensor of shape {tuple(x.shape)} cannot be cut into this rank's micro-batches: its "
                f"{local_n} samples lie along dimension 1 (sequence-first), and hetrain cuts along the first; "
                "collate batches batch-first (e.g. batch_first=True, transposing inside the model) or plan no "
                "micro-batches")
        return x

    piece = map_leaves(cut, batch, is_leaf=sample_leaves(batch, local_n))
    encodings = getattr(piece, "_encodings", None)   # a BatchEncoding's per-sample word_ids(), tokens(), ...
    if isinstance(encodings, list) and piece is not batch:
        piece._encodings = encodings[start:stop] if len(encodings) == local_n else None
    return piece


def empty_batch(batch: Any) -> Any:
    """A one-sample batch with its samples taken out (a rank with no samples in a step): what `slice_batch`
    cuts, cut to none; what belongs to the whole batch (a shared mask, a count) kept."""
    return slice_batch(batch, 0, 0, 1)


def has_per_sample_values(batch: Any, samples: int) -> bool:
    """Whether anything in the batch has one entry per sample: a tensor whose first dimension is the
    samples, or a list of one value (or list of values) per sample."""
    found = []

    def look(x: Any) -> Any:
        if isinstance(x, torch.Tensor) or is_array(x):
            found.append(len(x.shape) > 0 and x.shape[0] == samples)
        else:
            found.append(per_sample_values(x, samples) or per_sample_lists(x, samples))
        return x

    map_leaves(look, batch, is_leaf=sample_leaves(batch, samples))
    return any(found)


def split_batch(batch: Any, sizes: Sequence[int], local_n: int) -> Iterator[Any]:
    """The batch cut into consecutive pieces of the given sizes. A piece with no samples of a batch that has
    some is a stand-in, the batch's first two samples (a model need not take an empty batch, and BatchNorm
    takes no single sample in training), which the session counts as 0 items (its micro-batch size is 0). A
    batch with nothing of one entry per sample (rows that are not samples: a tokenizer's overflowing windows,
    sequences packed into one row) is refused: every piece would get all of it."""
    if len(sizes) == 1:
        yield batch
        return
    if local_n > 1 and not has_per_sample_values(batch, local_n):
        shapes = [tuple(t.shape) for t in tensors(batch)][:3]
        raise HetrainError(
            f"nothing in this rank's batch of {local_n} samples has one entry per sample (tensors of shapes "
            f"{shapes}): rows that are not samples (a tokenizer's return_overflowing_tokens windows, sequences "
            "packed into one row) cannot be cut into micro-batches, and every piece would get all of them; "
            "collate one row per sample, or plan no micro-batches (micro_batch null)")
    start = 0
    for size in sizes:
        yield slice_batch(batch, start, start + size, local_n) if size or local_n == 0 else \
            slice_batch(batch, 0, min(2, local_n), local_n)   # two: BatchNorm trains on no fewer
        start += size


# ---------------------------------------------------------------- measurement


class SavedActivations:
    """Distinct bytes kept for backward by a forward: what autograd saves, plus the inputs that
    checkpointed blocks keep to recompute; parameters (and views of them) are not counted."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module] = ()) -> None:
        self._model = model
        self._params = self._param_storages()
        self._blocks = [b for b in blocks if getattr(b, _CHECKPOINTED, False)]
        self._storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _param_storages(self) -> set[int]:
        # Under FSDP2 a block's parameters are unsharded, plain tensors, only while it runs: ask again then.
        return {local_tensor(p).untyped_storage().data_ptr() for p in self._model.parameters() if p.numel()}

    def _count(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.numel() and not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._params:
                self._params = self._param_storages()
            if ptr and ptr not in self._params:
                self._storages[ptr] = storage.nbytes()
        return t

    @contextmanager
    def measure(self) -> Iterator["SavedActivations"]:
        """Count during the forward run inside this context."""
        handles = [b.register_forward_pre_hook(lambda m, args: map_tensors(self._count, args)) for b in self._blocks]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._count, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()
