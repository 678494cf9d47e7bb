"""The state of one training step that the loader, `backward` and `step` share.

Weighting (docs/design.md, invariant 1). A rank's loss is its mean over its `num_items` items (tokens,
pixels; by default its samples). `backward` multiplies it by `num_items * world / estimate`,
where `estimate` is a guess of the global batch's items that every rank computes alike; DDP
averages over the world, so the summed gradient is `sum(items_i * grad_i) / estimate`. Once the
last backward of the step is done, the true global item count is all-reduced and the gradients
are multiplied by `estimate / global_items` (together with the loss scale's division), which
makes them the gradient of the mean over all items of the global batch, for any split, any
micro-batching and ranks with no items. For sample means the estimate is exact and the
correction is 1; for tokens the estimate is the step's samples times the last step's tokens per
sample, which keeps the loss near its usual magnitude (so fp16 loss scaling behaves as usual). The
run's first step has no last step: its first backward (under a pipeline, its first step, counted
on the last stages) agrees on tokens per sample (one small all-reduce of every rank's items and
samples), or a token-mean loss 200 times too heavy overflowed fp16 and skipped that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetrain.errors import HetrainError


@dataclass(frozen=True)
class StepTotals:
    """Job-wide figures of a finished step (the same on every rank)."""

    global_samples: int
    global_items: float
    loss: float | None
    local_samples: int
    local_items: float


class StepState:
    """Counts of the current step on this rank; the figures the loader sets and `backward` reads."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.local_samples: int | None = None   # this rank's samples of the step (None: no step begun)
        self.global_samples: int | None = None
        self.split: list[int] | None = None     # every rank's samples of the step, as the loader split it
        self.micro_samples: int | None = None   # samples of the current micro-batch
        self.last_micro = True                  # the current micro-batch is the step's last on this rank
        self.equal_pieces = False               # every rank runs the job's count of micro-batches a step
        self.items = 0.0                        # items this rank has passed to backward this step
        self.loss_sum: torch.Tensor | None = None   # sum of loss * items over this step's backwards
        self.backwards = 0
        self.micros = 0                         # micro-batches of the step handed out so far
        # the last finished step's global items / global samples; None until the run's first step agrees on one
        self.items_per_sample: float | None = None
        self.begun = 0                          # steps begun (tells one step's batch from the next)
        self.finished = 0                       # steps finished (a batch drawn and not stepped is not counted)
        self.last: StepTotals | None = None
        self.resumed_loss: float | None = None   # a resumed checkpoint's last loss, until this process's first step
        self.skipped_last = False               # this rank skipped its last finished step (replicated gradients:
                                                # the next step's figures check every rank did the same)
        self.closed = False                     # session.close() ran: no more steps

    @property
    def cut(self) -> bool:
        """The step is cut into micro-batches on this rank (a piece of its share in hand, more to come or done)."""
        return self.active and (self.micros > 1 or not self.last_micro)

    @property
    def buffer_source(self) -> int:
        """The rank whose buffers every rank takes after the step: the first with samples in it (rank 0's
        forward over no samples left its BatchNorm statistics as they were, and every rank took those)."""
        return next((r for r, n in enumerate(self.split or ()) if n > 0), 0)

    @property
    def active(self) -> bool:
        return self.global_samples is not None

    def begin_step(self, local_samples: int, global_samples: int, split: list[int] | None = None) -> None:
        """The loader hands out this rank's part of a new global batch (`split`: every rank's samples of it)."""
        self.check_open()
        self.local_samples, self.global_samples = int(local_samples), int(global_samples)
        self.split = list(split) if split is not None else None
        self.begun += 1
        self.micro_samples, self.last_micro = None, True
        self.items, self.loss_sum, self.backwards, self.micros = 0.0, None, 0, 0

    def begin_micro(self, samples: int, last: bool) -> None:
        """The loader hands out one micro-batch of the step."""
        self.micro_samples, self.last_micro = int(samples), bool(last)
        self.micros += 1

    def between_micro_batches(self) -> bool:
        """A later micro-batch of a step whose earlier ones ran backward: their gradients are pending."""
        return self.active and self.backwards > 0 and self.micros > 1

    def refuse_between_micro_batches(self, call: str, fix: str, forward: bool = True) -> None:
        """A collective of the script's own called between a step's micro-batches, which ranks may run different
        numbers of: the calls would not pair up (gloo's 'Received data size doesn't match', then SIGABRT). Where
        every rank runs the job's count (`equal_pieces`: FSDP2, SyncBatchNorm) one without a forward pairs. Refused
        after close() too: the session's process group is gone."""
        self.check_open()
        if self.active and not self.last_micro and (forward or not self.equal_pieces):   # its first piece too: a
            raise HetrainError(   # rank with fewer pieces makes fewer calls, whether before a backward or after
                f"{call} ran between the micro-batches of a step (before its last, where session.step() returns "
                f"False: the step has more): ranks run different numbers of micro-batches, so their calls would not "
                f"pair up; {fix}")

    def current_samples(self) -> int:
        return self.local_samples if self.micro_samples is None else self.micro_samples

    def estimate(self) -> float:
        """The global item count the weights divide by before the true one is known (same on all ranks)."""
        return max(self.global_samples * (self.items_per_sample or 1.0), 1.0)

    def weight(self, num_items: float) -> float:
        """What this backward's mean loss is multiplied by."""
        return num_items * self.world_size / self.estimate()

    def record_backward(self, loss: torch.Tensor, num_items: float) -> None:
        check_scalar_loss(loss)
        self.items += num_items
        self.backwards += 1
        if num_items > 0:
            value = loss.detach().to(torch.promote_types(loss.dtype, torch.float32)) * num_items   # fp64 kept
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value

    def finish(self, global_items: float, loss: float | None) -> StepTotals:
        """The step's job-wide figures are known: keep them and get ready for the next step."""
        if global_items > 0 and self.global_samples:
            self.items_per_sample = global_items / self.global_samples
        self.last = StepTotals(self.global_samples or 0, global_items, loss, self.local_samples or 0, self.items)
        self.finished += 1
        self.local_samples = self.global_samples = self.micro_samples = None
        self.last_micro, self.items, self.loss_sum, self.backwards, self.micros = True, 0.0, None, 0, 0
        return self.last

    @property
    def last_loss(self) -> float | None:
        """The last finished step's global-batch loss: this process's, else the resumed checkpoint's."""
        return self.last.loss if self.last is not None else self.resumed_loss

    def mean_weight(self) -> float:
        """This rank's weight in a mean over ranks: the current step's items so far (its samples before
        any backward), else the last finished step's items. Before this process's first step there are none
        (every rank weighed 0 and the mean was NaN): refused, naming `weight=`."""
        if self.active:
            return self.items or self.current_samples()
        if self.last is None:
            raise HetrainError(
                "session.global_mean(value) weighs each rank's value by its items in the step, and no step has "
                "run in this process yet (a figure before the first step, or before the first after a resume): "
                "pass weight= (1 for a plain mean over ranks, or the samples or tokens this rank's value is over)")
        return self.last.local_items

    def check_open(self) -> None:
        if self.closed:
            raise HetrainError("the session was closed (session.close(), or the end of its 'with' block): create a "
                               "new hetrain.Session() and prepare the model again to go on training")

    def require_batch(self, what: str) -> None:
        self.check_open()
        if not self.active:
            raise HetrainError(f"session.{what}() needs a batch from session.loader(); iterate the loader first")


ONE_MODEL = ("session.prepare() was already called; a session trains one model: a second model trained beside it "
             "(a GAN's) gets a session of its own (docs/porting.md), and one not trained (a frozen teacher, an EMA, a "
             "reference model) needs none: run it as it is")
ONE_DATASET = ("session.loader() was already called; a session reads one dataset, the training set: evaluate on a plain "
               "DataLoader of each rank's part with session.evaluate() or session.global_mean() (docs/data.md, "
               "Evaluation uses a plain DataLoader)")
GLOBAL_MEAN_FIX = "call it where session.step() returns True (session.loss is the finished step's loss)"


def check_scalar_loss(loss: object) -> None:
    """session.backward() takes the batch's mean loss: one element that autograd can go back from."""
    if not isinstance(loss, torch.Tensor):
        raise HetrainError(f"session.backward() takes the loss tensor the model's outputs gave; got a "
                           f"{type(loss).__name__} (a loss.item() or a number has no graph to go back through)")
    if loss.numel() != 1:
        raise HetrainError(f"session.backward() takes a scalar loss; got a tensor of shape {list(loss.shape)}: reduce "
                           "it to the batch's mean, e.g. loss.mean() (or loss.sum() / num_items with num_items=...)")


def check_has_graph(loss: object, num_items: float) -> None:
    """A loss that counts items must have a graph to go back through. Checked before the step counts this
    backward, so that the script can run the forward again and call session.backward() on the same batch."""
    check_scalar_loss(loss)
    if num_items > 0 and not loss.requires_grad:
        where = ("grad mode is off here (torch.set_grad_enabled(False) left on by an evaluation, or this call "
                 "inside torch.no_grad() or torch.inference_mode())" if not torch.is_grad_enabled() else
                 "its forward ran with grad mode off (inside torch.no_grad() or torch.inference_mode(), as an "
                 "evaluation's), or it was detached")
        raise HetrainError(f"the loss passed to session.backward() has no graph to go back through: {where}. "
                           "Nothing was counted: run the forward with grad enabled and call session.backward() "
                           "again for this batch")


def items_as_number(num_items: object) -> float:
    """`num_items` as a non-negative number (a Python number or a one-element tensor)."""
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise HetrainError(f"num_items is a tensor of {num_items.numel()} elements; pass the count of items, "
                               "e.g. num_items=(labels != -100).sum()")
        num_items = num_items.item()
    try:
        value = float(num_items)
    except (TypeError, ValueError):
        raise HetrainError(f"num_items={num_items!r} is not a number; pass how many items the loss averages "
                           "over (tokens, pixels)") from None
    if not value >= 0 or value == float("inf"):
        raise HetrainError(f"num_items={num_items!r} must be a count >= 0 of the items the loss averages over")
    return value
