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
FSDP2's sharded parameters are not accumulated by autograd, and a pipeline stage runs its own backward;
the checks between micro-batches below hold under FSDP2 too.)

Under micro-batches the loop body runs once per piece, so two more writes land between a step's pieces,
both refused: the first in that backward, as it reaches this model's outputs; the second at the next piece's
session backward:

- another session's backward through this model (a GAN's generator loss through its discriminator, frozen
  or not): its pieces run through this model before its step applies, and its gradient, where the
  parameters are not frozen, joins this model's step, where one process would have zeroed it;
- a change of the parameters themselves (a second optimizer of the script's own stepped in the loop
  body): it updates on one piece's local gradient, before the ranks' are summed, and the ranks part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from hetrain.errors import HetrainError

__all__ = ["PlainBackwards", "session_backward"]

_inside: list[object] = []   # the sessions' backwards running now, the innermost last (a GAN's generator loss
                             # reaches its discriminator)

AFTER = ("a loss.backward() of the script's own reached the model's parameters after session.backward() in this "
         "step: its gradient is not weighted by this rank's share of the global batch, and under DDP not all-reduced "
         "either, so the update would not be the global batch's; give every loss of a step to one "
         "session.backward(loss_a + loss_b). A step that takes two gradients in turn (SAM) cannot be run by "
         "session.step(); see docs/porting.md")
BEFORE = ("a loss.backward() of the script's own ran through this forward before session.backward(): DDP all-reduces "
          "the first backward of a forward only, so the session's would not be; give both losses to one "
          "session.backward(loss_a + loss_b)")
FOREIGN = ("another session's backward (a GAN's generator loss through this discriminator) went through this model "
           "between the micro-batches of its step: the loop body runs once per micro-batch, so the other model's "
           "pieces run through this one before its step applies, and their gradient (unless its parameters are "
           "frozen) joins this model's update, which one process would have zeroed; run sessions whose losses go "
           "through each other's models without micro-batches (no micro_batch in the plan's ranks)")
MOVED = ("the model's parameters changed between the micro-batches of one step: the loop body runs once per "
         "micro-batch, and an update of the script's own in it (a second optimizer's step(), an in-place change) "
         "used one piece's gradient before the ranks' were summed, so the ranks' models part; update once a step, "
         "after its last micro-batch: `if session.step(): other_optimizer.step()` (a module that changes its own "
         "weights in its forward, nn.Embedding(max_norm=...), cannot take micro-batches)")


@contextlib.contextmanager
def session_backward(owner: object = None) -> Iterator[None]:
    """The session's own backward runs inside (`owner`: its PlainBackwards): its accumulations are not the
    script's, and another session's step in progress tells them from its own."""
    _inside.append(owner)
    try:
        yield
    finally:
        _inside.pop()


class PlainBackwards:
    """Notes a backward of the script's own through `model`'s trainable `params`, and refuses the two cases
    above: `before_backward` at each session backward, `before_step` at the step."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
        self.since_forward = False   # a plain backward since the last training forward
        self.in_step = False         # a plain backward since the step's first session.backward()
        self._armed = False          # the step's first session.backward() ran
        self.foreign = False         # another session's backward reached the parameters between this step's pieces
        self._params = [p for p in params if p.requires_grad]
        self._versions: list[int] | None = None   # the parameters' in-place versions after a piece before the last
        self._output_hooks: list[Any] = []   # on outputs of forwards between pieces, dropped at the next piece
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params]
        self._handles.append(model.register_forward_pre_hook(self._forward))
        self._handles.append(model.register_forward_hook(self._output))

    def __getstate__(self) -> dict:
        """A copy of the prepared model (deepcopy, an AveragedModel of it) carries inert hooks: it notes nothing
        the session reads (the forward pre-hook is copied with the module; the parameters' hooks are not)."""
        return {"since_forward": False, "in_step": False, "_armed": False, "foreign": False, "_params": [],
                "_versions": None, "_output_hooks": [], "_handles": []}

    def remove(self) -> None:
        """The session closed: its hooks leave the parameters (a new session prepares them again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._drop_output_hooks()

    def _drop_output_hooks(self) -> None:
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = []

    def _accumulated(self, param: torch.Tensor) -> None:
        if not _inside:
            self.since_forward = True
            self.in_step = self.in_step or self._armed
        elif self._versions is not None and _inside[-1] is not self:
            self.foreign = True

    def _output(self, module: Any, args: Any, output: Any) -> None:
        """Between a step's pieces, a backward through this forward's outputs by another session (its parameters
        frozen or not) is refused. (An output that is a parameter itself is left to `_accumulated`.)"""
        if self._versions is None or not torch.is_grad_enabled():
            return
        for value in _tensors(output):
            if value.requires_grad and value.grad_fn is not None:
                self._output_hooks.append(value.register_hook(self._through))

    def _through(self, grad: torch.Tensor) -> None:
        """Refused at once, as the backward reaches this model's outputs (before its parameters: FSDP2's gathers and
        reduce-scatters would meet another rank's in the wrong order)."""
        if self._versions is not None and _inside and _inside[-1] is not self:
            raise HetrainError(FOREIGN)

    def _forward(self, module: Any, args: Any) -> None:
        if torch.is_grad_enabled():
            self.since_forward = False

    def before_backward(self, first_of_step: bool) -> None:
        if self.since_forward:
            self.since_forward = False
            raise HetrainError(BEFORE)
        if first_of_step:
            self._armed, self.in_step = True, False

    def check_pieces(self) -> None:
        """Before a session backward, ahead of anything it counts or sends: nothing wrote to the model between this
        piece and the step's last one (every rank reads the same)."""
        versions, self._versions, foreign, self.foreign = self._versions, None, self.foreign, False
        self._drop_output_hooks()
        if foreign:
            raise HetrainError(FOREIGN)
        if versions is not None and versions != [p._version for p in self._params]:
            raise HetrainError(MOVED)

    def after_backward(self, last_of_step: bool) -> None:
        """A piece's backward ended: before the step's last, the parameters' versions, which nothing changes until
        the step (a GAN's other session reaching them is noted from here on)."""
        self._versions = None if last_of_step else [p._version for p in self._params]

    def before_step(self) -> None:
        plain, self.in_step, self._armed, self._versions = self.in_step, False, False, None
        self._drop_output_hooks()
        if plain:
            raise HetrainError(AFTER)


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a forward's outputs, at any depth: torch's tree_flatten (as DDP's sink and the kept outputs
    take them), then into what it leaves whole, a dict or list subclass it does not know (`class Out(dict)`)."""
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, Mapping):
            yield from _tensors(list(leaf.values()))
        elif isinstance(leaf, (list, tuple)):
            yield from _tensors(list(leaf))
