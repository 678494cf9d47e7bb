"""A session's model prepared by its plan: a pipeline stage (the plan's layout), or the whole model
data parallel (DDP or FSDP2, with the comm hook the plan's world takes)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from hetrain.errors import HetrainError
from hetrain.runtime.parallelize import Prepared, parallelize
from hetrain.runtime.pipeline_schedule import prepare_pipeline
from hetrain.runtime.plan_entries import comm_for_world

__all__ = ["prepare_model"]

log = logging.getLogger("hetrain")


def prepare_model(session: Any, model: torch.nn.Module, optimizer: Any, blocks: Any,
                  find_unused: bool) -> tuple[Prepared, Any]:
    """(the prepared model, its pipeline runner or None) for `session`'s rank, plan and device."""
    if session.sharding != "fsdp" and not any(p.requires_grad for p in model.parameters()):   # DDP needs some
        raise HetrainError(f"session.prepare() was given a {type(model).__name__} with no parameter that requires a "
                           "gradient (none, or all frozen): a session trains parameters; unfreeze some "
                           "(p.requires_grad_(True)) before prepare(), or run this model without a session")
    if session.layout is not None:
        return prepare_pipeline(model, optimizer, session.plan.pipeline, session.layout, session.device,
                                session.entry.activation_checkpointing, session.autocast, session.emulated_speed,
                                session.sharding == "fsdp")
    comm, note = comm_for_world(session.plan, session.assignment) if session.plan is not None else (None, None)
    if note is not None and session.is_main:
        log.info("%s", note)
    state = session.state
    return parallelize(model, optimizer, sharding_name=session.sharding, entries=session.assignment.entries,
                       rank=session.rank, comm=comm, device=session.device, timer=session.timer, blocks=blocks,
                       find_unused_parameters=find_unused,
                       without_samples=lambda: state.active and state.current_samples() == 0,
                       in_step=lambda: state.active), None
