"""Every rank's rows of a tensor, for losses that look across ranks (contrastive, CLIP-style negatives).

Each rank holds its share of the global batch, and shares differ: torch's `all_gather` needs the
same size on every rank (two ranks of 40 and 24 samples stopped with gloo's "collective mismatch",
and a job on an even split stopped at its first re-split). `gather_rows` pads each rank's rows to the
longest share, gathers them, and joins the real rows in rank order, which is the global batch's
order (rank r's slice follows rank r-1's). The gradient reaches each rank's own rows: backward
all-reduces the gradient of the joined rows and each rank keeps its slice. Ranks that compute in
different precisions (a bf16 rank beside an fp32 one) gather in fp32, and each gets the rows back in
its own dtype. A loss that stays exact for
any split is each rank's mean over its own rows against every rank's columns (docs/porting.md,
"Losses across ranks").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.watchdog import collective_call

_SHAPE_DIMS = 8   # trailing dimensions compared across ranks
_DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


class _GatherRows(torch.autograd.Function):
    """[world, rows, ...] of every rank's padded rows; backward sums every rank's gradient, keeps this rank's."""

    @staticmethod
    def forward(ctx: Any, padded: torch.Tensor, waiting: Callable[[], ContextManager]) -> torch.Tensor:
        ctx.waiting = waiting
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, padded)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        with ctx.waiting():   # in the rank's backward: its wait for a slower rank's is not its compute
            dist.all_reduce(grad)
        return grad[dist.get_rank()], None


GATHER_NODE = "_GatherRowsBackward"   # its node in an autograd graph (a backward without items goes through it)


def gather_rows(tensor: torch.Tensor, *, offset: bool = False, cut: bool = False,
                waiting: Callable[[], ContextManager] = contextlib.nullcontext) -> Any:
    """Every rank's `tensor` joined along the first dimension in rank order (sizes may differ by rank); the
    gradient reaches each rank's own rows. With `offset=True`, (rows, index of this rank's first row). Collective:
    every rank calls it, once per forward, with the same trailing shape. `cut`: this rank's step is cut into
    micro-batches, where it would join pieces, not the global batch (refused on every rank). `waiting`: the
    context its collectives run in (the session times a rank's wait there as waiting, not compute)."""
    if tensor.dim() == 0:
        raise HetrainError("session.gather_rows() joins rows along the first dimension; got a 0-d tensor "
                           "(give it a dimension of rows: t.reshape(1))")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return (tensor, 0) if offset else tensor
    dtype = tensor.dtype
    if tensor.is_floating_point() and tensor.element_size() < 4:
        tensor = tensor.float()   # a bf16 rank beside an fp32 one: one dtype on the wire, the rank's own back
    with collective_call(None, "gather_rows"), waiting():   # a rank that waits here alone is named with the call
        sizes = _agreed_sizes(tensor, cut)
    longest, rank = max(sizes), dist.get_rank()
    padded = tensor.contiguous()
    if tensor.shape[0] < longest:
        padded = torch.cat([padded, padded.new_zeros(longest - tensor.shape[0], *tensor.shape[1:])])
    with waiting():
        if tensor.requires_grad:
            parts = _GatherRows.apply(padded, waiting)
        else:
            parts = [torch.empty_like(padded) for _ in range(len(sizes))]
            dist.all_gather(parts, padded)
    rows = torch.cat([part[:size] for part, size in zip(parts, sizes)]).to(dtype)
    return (rows, sum(sizes[:rank])) if offset else rows


def _agreed_sizes(tensor: torch.Tensor, cut: bool = False) -> list[int]:
    """Every rank's row count, with a check (on every rank alike) that the rest of the shape and the dtype agree,
    and that no rank's step is cut into micro-batches."""
    if tensor.dim() - 1 > _SHAPE_DIMS:
        raise HetrainError(f"session.gather_rows() takes tensors of at most {_SHAPE_DIMS + 1} dimensions")
    trailing = list(tensor.shape[1:]) + [-1] * (_SHAPE_DIMS - tensor.dim() + 1)
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    mine = torch.tensor([tensor.shape[0], tensor.dim(), dtype, *trailing, int(cut)], dtype=torch.int64,
                        device=tensor.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    cuts = [i for i, e in enumerate(every) if e[-1]]
    if cuts:
        raise HetrainError(
            f"session.gather_rows() on a micro-batch: rank(s) {', '.join(map(str, cuts))} cut this step into "
            "micro-batches, where each call joins one piece of each rank's share, not the global batch (a "
            "contrastive loss over pieces is another loss; ranks with different piece counts stop the job); run "
            "this loss on a plan without micro_batch or grad_accum")
    rows = [e[:-1].tolist() for e in every]
    if any(r[1:] != rows[0][1:] for r in rows):
        shapes = [f"rank {i}: {'x'.join(str(d) for d in ['rows', *r[3:3 + r[1] - 1]])}" for i, r in enumerate(rows)]
        raise HetrainError("session.gather_rows() was given tensors of different shapes or dtypes on different "
                           f"ranks ({', '.join(shapes)}); every rank passes its rows of one tensor")
    return [r[0] for r in rows]
