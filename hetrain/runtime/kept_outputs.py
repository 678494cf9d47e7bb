"""A rank without items in a step, under DDP's find_unused_parameters: its zeros go through the forward's outputs
its loss took.

DDP passes every output of a forward through one autograd node (its output sink) and counts as unused the
parameters a backward does not reach from there. A rank with no items cannot run its loss's own backward (a mean
over no items is 0/0, and its backward NaN), so it sends zeros. Zeros from the parameters themselves, a graph
apart from the forward's, made DDP count every parameter some output reaches as used, and every rank then
stepped a zero gradient for a head the loss leaves (weight decay and momentum moved it). The zeros go through the
outputs the loss took instead, each along its own branch of the sink: an output the model computed its loss from
inside the forward (a Hugging Face model's logits, given labels) counts too, and a non-finite one (that loss,
over no items) is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten   # the flattening DDP's sink takes a forward's outputs by

SINK = "_DDPSinkBackward"


def _never() -> bool:
    """A copy's outputs are never kept (no session tells it when a step is out)."""
    return False


def zeros_through(tensors: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    """A zero whose backward reaches each of `tensors` with zeros (and the loss's value, NaN or not, not at all). In
    float32: a half tensor's backward casts the loss scale to its dtype (65536 is past fp16's 65504: inf, and inf x 0
    is NaN); float() casts the zero gradient back instead. nan_to_num: a non-finite value sends no NaN either."""
    start = torch.nan_to_num(loss.detach().float()) * 0.0
    return sum((torch.nan_to_num(t.float()).sum() * 0.0 for t in tensors), start)


class KeptOutputs:
    """The last training forward's output tensors (DDP's forward hook, held until the next training forward),
    and where each value of the output stands among the tensors the sink takes (its outputs count every value
    of the output, ints and None too; its inputs are the tensors alone)."""

    def __init__(self, every_forward: bool = False, in_step: Callable[[], bool] = lambda: True) -> None:
        self.tensors: list[torch.Tensor] = []
        self.tensor_index: dict[int, int] = {}
        # FSDP2 (no sink): the outputs of every training forward since the last backward, for a loss may take a
        # model run twice (two views), and the zeros must reach each run's collectives as the others' backward does
        self.every_forward = every_forward
        self.in_step = in_step   # whether a step's batch is out: forwards outside one are no training forwards

    def __getstate__(self) -> dict:
        """A copy of the model its hooks are on (deepcopy, an EMA's AveragedModel, torch.save) holds no outputs."""
        return {"tensors": [], "tensor_index": {}, "every_forward": self.every_forward, "in_step": _never}

    def clear(self, *_: Any) -> None:
        """A forward pre-hook: a training forward begins (an evaluation under no_grad keeps them)."""
        if torch.is_grad_enabled() and not self.every_forward:
            self.drop()

    def drop(self) -> None:
        """The outputs are of no more use (their backward ran): held no longer."""
        self.tensors, self.tensor_index = [], {}

    def note(self, _module: Any, _args: Any, output: Any) -> None:
        """A forward hook: a training forward's outputs."""
        if not torch.is_grad_enabled() or not self.in_step():
            return
        leaves, _ = tree_flatten(output)
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        outputs = [leaves[i] for i in positions if leaves[i].requires_grad]
        if self.every_forward:
            self.tensors = self.tensors + outputs
            return
        self.tensor_index = {i: k for k, i in enumerate(positions)}
        self.tensors = outputs

    def zeros(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Zeros through the outputs `loss` took, or None where it took none that is finite."""
        edges = self.edges(loss)
        used = [t for t in self.tensors if t.grad_fn is not None and self.taken(t, edges)
                and bool(torch.isfinite(t.detach()).all())]
        self.drop()
        if not used:
            return None
        return zeros_through(used, loss)

    def _branch(self, fn: Any, nr: int) -> tuple | None:
        """The sink's input for its output `nr` (the tensor DDP passed through), else None."""
        k = self.tensor_index.get(nr)
        nexts = fn.next_functions
        return (nexts[k],) if fn.name() == SINK and k is not None and k < len(nexts) else None

    def edges(self, loss: torch.Tensor) -> set[tuple[Any, int]]:
        """(node, output index) of every tensor the loss's graph takes in, and of the loss; through the sink only
        the branch of the output the loss took."""
        root = (loss.grad_fn, loss.output_nr)
        edges, todo = {root}, [root]
        while todo:
            fn, nr = todo.pop()
            for edge in self._branch(fn, nr) or fn.next_functions:
                if edge[0] is not None and edge not in edges:
                    edges.add(edge)
                    todo.append(edge)
        return edges

    def taken(self, output: torch.Tensor, edges: set[tuple[Any, int]]) -> bool:
        """Whether the loss took `output`: after the sink, or before it (the tensor the sink passed through)."""
        fn, nr = output.grad_fn, output.output_nr
        if (fn, nr) in edges:
            return True
        branch = self._branch(fn, nr)
        return branch is not None and branch[0] in edges
