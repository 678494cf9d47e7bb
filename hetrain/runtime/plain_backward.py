"""A `loss.backward()` of the script's own that reaches the prepared model's parameters inside a step.

`session.backward(loss)` weights each rank's loss by its share of the global batch; a plain
`loss.backward()` does not, so on an uneven split its gradient is not the global batch's. Before a
step's first `session.backward()` such gradients are left out of the step (`step_guard.drop_stale_gradients`);
these are the two cases where they would not be:

- after the step's first `session.backward()` (a second loss backward-ed on its own, the second pass
  of a two-pass update such as SAM): its unweighted gradient joins the update, and under DDP a
  backward without a forward of its own is not even all-reduced, so the ranks' models part;
- before `session.backward()` on the same forward (`aux.backward(retain_graph=True)`): DDP reduces
  the first backward of a forward only, so the session's backward would not be reduced.

Each trainable parameter carries a hook after its gradient is accumulated; the session's own
backwards run inside `session_backward()`, where the hooks note nothing. (Replicated parameters only:
FSDP2's sharded parameters are not accumulated by autograd, and a pipeline stage runs its own backward.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hetrain.errors import HetrainError

__all__ = ["PlainBackwards", "session_backward"]

_inside = 0   # session backwards running now (any session's: a GAN's generator loss reaches its discriminator)

AFTER = ("a loss.backward() of the script's own reached the model's parameters after session.backward() in this "
         "step: its gradient is not weighted by this rank's share of the global batch, and under DDP not all-reduced "
         "either, so the update would not be the global batch's; give every loss of a step to one "
         "session.backward(loss_a + loss_b). A step that takes two gradients in turn (SAM) cannot be run by "
         "session.step(); see docs/porting.md")
BEFORE = ("a loss.backward() of the script's own ran through this forward before session.backward(): DDP all-reduces "
          "the first backward of a forward only, so the session's would not be; give both losses to one "
          "session.backward(loss_a + loss_b)")


@contextlib.contextmanager
def session_backward() -> Iterator[None]:
    """The session's own backward runs inside: its accumulations are not the script's."""
    global _inside
    _inside += 1
    try:
        yield
    finally:
        _inside -= 1


class PlainBackwards:
    """Notes a backward of the script's own through `model`'s trainable `params`, and refuses the two cases
    above: `before_backward` at each session backward, `before_step` at the step."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
        self.since_forward = False   # a plain backward since the last training forward
        self.in_step = False         # a plain backward since the step's first session.backward()
        self._armed = False          # the step's first session.backward() ran
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params if p.requires_grad]
        self._handles.append(model.register_forward_pre_hook(self._forward))

    def __getstate__(self) -> dict:
        """A copy of the prepared model (deepcopy, an AveragedModel of it) carries inert hooks: it notes nothing
        the session reads (the forward pre-hook is copied with the module; the parameters' hooks are not)."""
        return {"since_forward": False, "in_step": False, "_armed": False, "_handles": []}

    def remove(self) -> None:
        """The session closed: its hooks leave the parameters (a new session prepares them again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _accumulated(self, param: torch.Tensor) -> None:
        if _inside == 0:
            self.since_forward = True
            self.in_step = self.in_step or self._armed

    def _forward(self, module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            self.since_forward = False

    def before_backward(self, first_of_step: bool) -> None:
        if self.since_forward:
            self.since_forward = False
            raise HetrainError(BEFORE)
        if first_of_step:
            self._armed, self.in_step = True, False

    def before_step(self) -> None:
        plain, self.in_step, self._armed = self.in_step, False, False
        if plain:
            raise HetrainError(AFTER)
