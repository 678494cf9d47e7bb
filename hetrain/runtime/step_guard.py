"""The prepared optimizer steps only inside `session.step()`.

`session.step()` finishes the step's gradients first: divided by the global batch's item count,
unscaled, checked for inf and NaN on every rank, clipped if asked. An `optimizer.step()` of the
user's own would apply them unfinished (a gradient norm 13x the single process's was measured), and
one before `session.step()` would update twice. A step pre-hook refuses both with one line. A
step over zero gradients is let through: torch's distributed checkpoint takes one, at learning
rate 0, to create an optimizer's state before it is saved (`_init_optim_state`).

`zero_grad()` of the optimizer or the model, a habit of ported loops, is harmless between steps
(`session.step()` leaves no gradient), but between a step's micro-batches it discards the earlier
ones' gradients, and `torch.nn.utils.clip_grad_norm_` there clips a part of the step's gradient:
the next `session.backward()` finds the gradients gone or changed since the last backward left them
and refuses the step. (Neither the optimizer nor the model is patched for it: a module with a
function of hetrain's among its attributes could no longer be pickled whole.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hetrain.errors import HetrainError

OUTSIDE_STEP = ("optimizer.step() was called outside session.step(); call session.step() alone: it finishes "
                "the gradients over the global batch (item count, loss scale, inf check, clipping), then steps "
                "the optimizer and zeroes the gradients")


MID_STEP_ZERO = ("the gradients of this step's earlier micro-batches are gone: a zero_grad() between a step's "
                 "micro-batches discards them; remove it (session.step() zeroes the gradients after each step)")
MID_STEP_CHANGED = ("the gradients of this step's earlier micro-batches were changed after their backward: a "
                    "zero_grad(set_to_none=False) between a step's micro-batches discards them (remove it: "
                    "session.step() zeroes the gradients after each step), and torch.nn.utils.clip_grad_norm_ "
                    "clips a part of the step (call session.clip_grad_norm_, which clips the whole step once)")


class OptimizerStepGuard:
    """Refuses the optimizer's step unless `session.step()` is running it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.inside = False
        self.handle = optimizer.register_step_pre_hook(self._check)

    def _check(self, optimizer, args, kwargs) -> None:
        if not self.inside and _holds_gradients(optimizer):
            raise HetrainError(OUTSIDE_STEP)

    @contextmanager
    def allowed(self) -> Iterator[None]:
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def _holds_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter the optimizer steps holds a gradient that is not zero (on this rank)."""
    return holds_gradients((p for g in optimizer.param_groups for p in g["params"]), shard_counts=False)


def gradients_pending(model: torch.nn.Module) -> bool:
    """Whether any parameter holds a gradient that is not zero (one no step has used): the same answer
    on every rank, so a sharded (DTensor) gradient counts when present (its shard may be all zeros)."""
    return holds_gradients(model.parameters(), shard_counts=True)


def holds_gradients(params, *, shard_counts: bool) -> bool:
    """Whether any of `params` holds a gradient that is not zero; with `shard_counts` a sharded
    gradient counts when present, else by its local shard."""
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):
            if shard_counts or bool(g.to_local().any()):
                return True
        elif bool(g.any()):
            return True
    return False


class KeptGradients:
    """Between a step's micro-batches, the gradients stay as the last backward left them."""

    def __init__(self) -> None:
        self._left: tuple | None = None

    def check(self, module: torch.nn.Module, state) -> None:
        """Before a backward: a step whose earlier micro-batches ran backward still holds their gradients."""
        if not state.between_micro_batches():
            self._left = None
            return
        if not any(p.grad is not None for p in module.parameters()):
            raise HetrainError(MID_STEP_ZERO)
        if self._left is not None and grad_versions(module) != self._left:
            raise HetrainError(MID_STEP_CHANGED)

    def after_backward(self, module: torch.nn.Module, state) -> None:
        """Note the gradients a backward left, when more of the step's micro-batches follow."""
        self._left = None if state.last_micro else grad_versions(module)


def grad_versions(module: torch.nn.Module) -> tuple:
    """Each gradient tensor and its in-place version counter: changed by zero_(), mul_(), any in-place write.
    (torch offers the counter as `Tensor._version` only; torch.utils.checkpoint reads it the same way.)"""
    return tuple((id(p.grad), p.grad._version) for p in module.parameters() if p.grad is not None)
