"""The prepared optimizer steps only inside `session.step()`.

`session.step()` finishes the step's gradients first: divided by the global batch's item count,
unscaled, checked for inf and NaN on every rank, clipped if asked. An `optimizer.step()` of the
user's own would apply them unfinished (a gradient norm 13x the single process's was measured), and
one before `session.step()` would update twice. A step pre-hook refuses both with one line. A
step over zero gradients is let through: torch's distributed checkpoint takes one, at learning
rate 0, to create an optimizer's state before it is saved (`_init_optim_state`).

`zero_grad()` of the prepared optimizer or model, a habit of ported loops, is harmless between
steps (`session.step()` leaves no gradient), but between a step's micro-batches it discards the
earlier ones' gradients: it is refused there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from hetrain.errors import HetrainError

OUTSIDE_STEP = ("optimizer.step() was called outside session.step(); call session.step() alone: it finishes "
                "the gradients over the global batch (item count, loss scale, inf check, clipping), then steps "
                "the optimizer and zeroes the gradients")


MID_STEP_ZERO = ("zero_grad() was called between a step's micro-batches: it would discard the earlier ones' "
                 "gradients; remove it (session.step() zeroes the gradients after each step)")


class OptimizerStepGuard:
    """Refuses the optimizer's step unless `session.step()` is running it, and `zero_grad()` of the
    optimizer or the `modules` in the middle of a step (`mid_step()`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, modules: list[torch.nn.Module] = (),
                 mid_step: Callable[[], bool] = lambda: False) -> None:
        self.inside = False
        self.mid_step = mid_step
        self.handle = optimizer.register_step_pre_hook(self._check)
        for owner in [optimizer, *modules]:
            owner.zero_grad = self._guarded(owner.zero_grad)

    def _check(self, optimizer, args, kwargs) -> None:
        if not self.inside and _holds_gradients(optimizer):
            raise HetrainError(OUTSIDE_STEP)

    def _guarded(self, zero_grad: Callable[..., None]) -> Callable[..., None]:
        def guarded(set_to_none: bool = True) -> None:
            if not self.inside and self.mid_step():
                raise HetrainError(MID_STEP_ZERO)
            zero_grad(set_to_none=set_to_none)

        return guarded

    @contextmanager
    def allowed(self) -> Iterator[None]:
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def _holds_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter the optimizer steps holds a gradient that is not zero."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and bool((g.to_local() if hasattr(g, "to_local") else g).any()):
                return True
    return False


def gradients_pending(model: torch.nn.Module) -> bool:
    """Whether any parameter holds a gradient that is not zero (one no step has used). A sharded
    (DTensor) gradient counts when present: its local shard alone may be all zeros on one rank."""
    return any(p.grad is not None and (hasattr(p.grad, "to_local") or bool(p.grad.any()))
               for p in model.parameters())
