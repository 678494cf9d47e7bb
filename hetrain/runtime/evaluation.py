"""`session.evaluate`: a validation loss under any plan, pipelines included, forward only.

Each rank passes its part of the evaluation set (a plain DataLoader over its slice, or its share of
a batch); the result is the mean over every rank's items, weighted by them, the same on every rank.
Under data parallelism the rank's batch runs through the script's model (inside DDP's wrapper:
no collective, so a rank with an empty part runs none; FSDP2's sharded model gathers its weights
on every rank) under `torch.no_grad()` and the rank's autocast; under a pipeline the replica's
ranks gather their parts into one batch and run it through every stage with torch's schedule
`eval` (no stage holds the whole model, so `model(x)` cannot run there). Neither counts as the
step's compute, nor moves the data position.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.batch_tree import tensors
from hetrain.runtime.pipeline_schedule import call_model, item_counter
from hetrain.runtime.step_guard import any_rank, warn_if_training
from hetrain.runtime.step_state import items_as_number
from hetrain.runtime.watchdog import collective_call


def evaluate(session: Any, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             num_items: Any = None) -> float:
    """The item-weighted mean of `loss_fn(model(*inputs), target)` over every rank's batch (collective)."""
    with collective_call(session.watch, "evaluate"):   # a stall here names the call
        return _evaluate(session, inputs, target, loss_fn, num_items)


def _evaluate(session: Any, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
              num_items: Any) -> float:
    if session.prepared is None:
        raise HetrainError("call session.prepare(model, optimizer) before session.evaluate()")
    session.state.refuse_between_micro_batches("session.evaluate()", "evaluate where session.step() returns True, "
                                               "e.g. if session.step() and session.step_count % N == 0:")
    warn_if_training(session.prepared.module)
    if session.pipeline is not None and num_items is not None and not callable(num_items):
        total, items = _pipeline_counted(session, inputs, target, loss_fn, items_as_number(num_items))
    elif session.pipeline is not None:
        inputs, target = session.pipeline.gather_batch((inputs, target))
        total, items = session.pipeline.evaluate(inputs, target, loss_fn, item_counter(num_items))
    elif _agreed_empty(inputs, session):   # a rank whose part is empty runs no forward and counts nothing
        total, items = 0.0, 0.0
    else:   # the script's model inside DDP's wrapper
        with torch.no_grad(), session.autocast():
            loss = loss_fn(call_model(session.prepared.module, inputs), target)
        items = batch_items(num_items, inputs, target)
        total = float(loss.detach()) * items if items > 0 else 0.0   # a Python float: an fp64 loss stays exact
    sums = torch.tensor([total, items], dtype=torch.float64, device=session.device)
    dist.all_reduce(sums)
    return float(sums[0] / sums[1]) if float(sums[1]) > 0 else math.nan


def _pipeline_counted(session: Any, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                      items: float) -> tuple[float, float]:
    """A pipeline's evaluation where each rank gives its part's items as a number, as under data parallelism: the
    replica's batch runs as one micro-batch (each micro-batch's items are not known), its mean loss weighted by the
    sum of its ranks' numbers."""
    counted = torch.tensor([items], dtype=torch.float64, device=session.device)
    dist.all_reduce(counted, group=session.pipeline.pipe_group)
    inputs, target = session.pipeline.gather_batch((inputs, target))
    return session.pipeline.evaluate(inputs, target, loss_fn, lambda _target: float(counted), microbatches=1)


def batch_items(num_items: Any, inputs: Any, target: Any) -> float:
    """The items of a data-parallel rank's batch: `num_items` (a number, or a function of the target), else its
    samples: the rows of the target's tensors, or of the inputs' where the target has none (a Hugging Face model
    takes its `labels` with its inputs, target None), which must all agree."""
    if callable(num_items):
        return items_as_number(num_items(target))
    if num_items is not None:
        return items_as_number(num_items)
    rows = {t.shape[0] for t in tensors(target) if t.dim() > 0} or {t.shape[0] for t in tensors(inputs) if t.dim() > 0}
    if len(rows) != 1:   # none, or tensors of several lengths (a class-weight vector, a detection target's boxes)
        where = "the target" if any(t.dim() > 0 for t in tensors(target)) else "the inputs"
        raise HetrainError(f"session.evaluate() cannot tell the batch's samples from {where} (tensors of "
                           f"{', '.join(map(str, sorted(rows))) or 'no'} rows): pass num_items= (a number, or a "
                           "function of the target)")
    return float(rows.pop())


def _agreed_empty(inputs: Any, session: Any) -> bool:
    """Whether this rank's part holds no sample (every tensor in it has 0 rows). Under FSDP2 every rank's
    forward gathers the weights with the others', so the ranks agree first and refuse an empty part."""
    leaves = tensors(inputs)
    empty = bool(leaves) and all(t.dim() > 0 and t.shape[0] == 0 for t in leaves)
    if session.sharding != "fsdp":
        return empty
    if any_rank([empty], session.device)[0]:
        raise HetrainError("session.evaluate() under sharding 'fsdp' got an empty part on some rank: each rank's "
                           "forward gathers the weights with the other ranks', so every rank needs at least one "
                           "sample; split an evaluation set of at least as many samples as ranks so that no part "
                           "is empty (padding by repeating samples would weigh them twice in the mean)")
    return False
