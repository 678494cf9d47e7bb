"""The step's gradients made final: unscaled, normalised by the global item count, checked, clipped.

After the last backward of a step the gradients hold `sum(items_i * grad_i) * scale / estimate`
(see `hetrain.runtime.step_state`). One small all-reduce per step (this rank's items, its loss sum
and, for sharded gradients, whether they are finite) gives every rank the same global item count,
the same verdict on overflow and the step's global mean loss; under DDP it is launched before the
last backward and travels while backward computes, and the gradients are then divided by the loss
scale and by `global_items / estimate` in one fused pass that also checks them (under ZeRO-1 the
ranks' verdicts then agree in one scalar all-reduce). Sharded gradients
and pipeline stages check theirs first (the verdict travels in the all-reduce), then correct them
in a second pass. A non-finite
gradient on any rank, in any precision, makes every rank skip the step (docs/design.md, invariant 4).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.step_state import StepState
from hetrain.runtime.watchdog import collective_call

log = logging.getLogger("hetrain")


@dataclass(frozen=True)
class GradientStatus:
    """The verdict on one step's gradients (identical on every rank)."""

    found_inf: bool
    global_items: float
    loss: float | None
    stop: bool = False   # some rank asked the job to stop (SIGTERM) before this step's figures left it
    bad_losses: tuple[float, float] = (0.0, 0.0)   # ranks whose own loss was not finite: their count, sum of rank + 1

    def where(self) -> str:
        """Where a skipped step's non-finite values began, as far as its figures tell: whose loss."""
        count, ranks = round(self.bad_losses[0]), round(self.bad_losses[1])
        if count == 0:
            return "every rank's loss was finite: the overflow came in backward"
        return f"the loss was not finite on {f'rank {ranks - 1}' if count == 1 else f'{count} ranks'}"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def gradients(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _unscale_and_check(grads: Sequence[torch.Tensor], inv_scale: float, device: torch.device) -> torch.Tensor:
    """Multiply local gradients by inv_scale and return 1.0 if any is non-finite (torch's fused AMP kernel)."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        g = torch.view_as_real(g) if g.is_complex() else g   # the kernel takes real tensors; a view unscales in place
        by_device[(g.device, g.dtype)].append(g)
    for (dev, dtype), group in by_device.items():
        here = found if dev == device else torch.zeros(1, dtype=torch.float32, device=dev)
        factor = inv_scale
        if dtype == torch.float64 and inv_scale != 1.0:
            torch._foreach_mul_(group, inv_scale)   # the kernel's factor is fp32: a double model keeps double's
            factor = 1.0
        inv = torch.full((), factor, dtype=torch.float32, device=dev)   # the kernel's type, whatever the default
        torch._amp_foreach_non_finite_check_and_unscale_(group, here, inv)
        if here is not found:
            found += here.to(device)
    return found


def has_non_finite(grads: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether any of `grads` holds inf or NaN (torch's fused AMP check at scale 1: one kernel per device)."""
    return bool(grads) and bool(_unscale_and_check(grads, 1.0, device).item())


@dataclass
class StepFigures:
    """The step's (items, -, loss sum, losses, stop) all-reduce, launched before the last backward so that it
    travels while backward computes (gradients that end replicated on every rank need no more)."""

    packet: torch.Tensor
    work: Any = None   # its own all-reduce; None when it travels with a gradient bucket


def _packet(state: StepState, device: torch.device, stop: bool) -> torch.Tensor:
    """(items, ranks that skipped the last step, loss sum, losses, stop, steps begun and their square, ranks whose
    loss is not finite and the sum of their rank + 1): summed over the ranks. With sharded gradients the second
    figure is replaced by this step's verdict on them."""
    has_loss = 1.0 if state.loss_sum is not None else 0.0
    # exact in the float32 bucket the figures may ride in: the ranks' sum of squares stays below 2**24 up to
    # 4,000 ranks (counted modulo 1024 it passed 2**24 at step 995 on 17 ranks, and stopped a healthy job)
    begun = float(state.begun % 64)
    rank = dist.get_rank() if dist.is_initialized() else 0
    packet = torch.tensor([state.items, float(state.skipped_last), 0.0, has_loss, float(stop), begun, begun ** 2,
                           0.0, float(rank + 1)], dtype=torch.float64, device=device)
    if state.loss_sum is not None:   # on the device, without waiting for it
        packet[2] = state.loss_sum.to(device=device, dtype=torch.float64)
        packet[7] = (~torch.isfinite(packet[2])).to(torch.float64)
    packet[8] *= packet[7]
    return packet


def launch_step_figures(state: StepState, device: torch.device, group: dist.ProcessGroup | None = None, *,
                        with_gradients: Any = None, stop: bool = False) -> StepFigures:
    """Start summing the step's item count and loss over the ranks (call it before the last backward):
    in a gradient bucket's all-reduce when `with_gradients` (the DDP hook state) takes them,
    else in an all-reduce of their own. `stop`: this rank was asked to stop (the job saves and ends
    at this step's end when any rank was)."""
    packet = _packet(state, device, stop)
    if with_gradients is not None:
        figures = StepFigures(packet)
        with_gradients.figures = figures
        return figures
    return StepFigures(packet, dist.all_reduce(packet, group=group, async_op=True))


def finish_gradients(params: Iterable[torch.nn.Parameter], state: StepState, loss_scale: float,
                     device: torch.device, group: dist.ProcessGroup | None = None,
                     launched: StepFigures | None = None, stop: bool = False) -> GradientStatus:
    """Unscale, agree on the step's figures, normalise by the global item count (collective).

    With `launched` figures the gradients are replicated (DDP, ZeRO-1): one fused pass unscales,
    corrects and checks them, and each rank's check of the same gradients is every rank's verdict (a
    gradient a script makes non-finite on one rank later is the step's own check, in `session.step()`).
    Otherwise (sharded FSDP2 gradients, pipeline stages) the verdict travels in one all-reduce with
    the figures.
    """
    grads = [local_tensor(g) for g in gradients(params)]
    if launched is not None:   # the figures are known first: one fused pass unscales, corrects and checks
        if launched.work is not None:
            launched.work.wait()
        global_items, skipped_last, loss_sum, losses, stops, *begun, bad_n, bad_ranks = launched.packet.tolist()
        check_skips_agreed(skipped_last, dist.get_world_size(group))
        check_same_batch(begun, state.begun, dist.get_world_size(group))
        correction = state.estimate() / global_items if global_items > 0 else 1.0
        found = _unscale_and_check(grads, correction / loss_scale, device)
        bad = float(found.item())
    else:   # each rank's verdict on overflow travels with the figures: check first, correct after
        found = _unscale_and_check(grads, 1.0 / loss_scale, device)
        packet = _packet(state, device, stop)
        packet[1] = found.to(torch.float64)[0]
        dist.all_reduce(packet, group=group)
        global_items, bad, loss_sum, losses, stops, *begun, bad_n, bad_ranks = packet.tolist()
        check_same_batch(begun, state.begun, dist.get_world_size(group))
        if bad == 0 and global_items > 0 and grads and state.estimate() != global_items:
            torch._foreach_mul_(grads, state.estimate() / global_items)   # one kernel per device, as torch clips
    found_inf = bad > 0 or loss_sum != loss_sum
    loss = loss_sum / global_items if losses > 0 and global_items > 0 else None
    return GradientStatus(found_inf=found_inf, global_items=global_items, loss=loss, stop=stops > 0,
                          bad_losses=(bad_n, bad_ranks))


def check_same_batch(begun: list[float], mine: int, world: int) -> None:
    """Every rank is at the same global batch: the ranks' counts of batches drawn agree (their sum and sum of
    squares tell the spread, alike on every rank; counted modulo 64). A loop that skips a bad batch on one
    rank (`continue` before session.backward) pairs its slices with the others' next batch's for the rest of
    the run: samples lost and repeated, silently."""
    total, squares = begun
    if squares * world != total * total:
        raise HetrainError(
            f"the ranks are at different global batches (this rank has drawn {mine} since the run began): a rank "
            "drew a batch and went on without session.backward() and session.step() (a `continue` past a bad batch "
            "on one rank), and its slices now pair with the others' next batch; every rank takes part in every "
            "step: give such a batch session.backward(loss, num_items=0) on that rank (it counts nothing), or skip "
            "it on every rank; a look at the data on one rank (`if rank == 0: next(iter(loader))`) reads the "
            "dataset itself (loader.dataset[i]), not the loader")


def check_skips_agreed(skipped: float, world: int) -> None:
    """Replicated gradients give every rank the same verdict on overflow, unless they changed on some ranks
    after the all-reduce: then some ranks skipped the last step and others applied it, and the model copies
    (and an fp16 job's loss scales) differ from then on, silently. The next step's figures say so."""
    if 0 < round(skipped) < world:
        raise HetrainError(
            f"{round(skipped)} of {world} ranks skipped the last step for non-finite gradients and the others applied "
            "it: the gradients changed on some ranks after they were all-reduced (a hook or code between "
            "session.backward() and session.step() that writes them on one rank, or a faulty device), and the ranks' "
            "copies of the model now differ; remove that change and restart from the last checkpoint")


def agree_items_per_sample(items: float, samples: int, device: torch.device,
                           group: dist.ProcessGroup | None = None) -> float:
    """Items per sample over every rank's first backward of the run (collective): the first step's estimate."""
    t = torch.tensor([float(items), float(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    total_items, total_samples = t.tolist()
    return total_items / total_samples if total_samples > 0 and total_items > 0 else 1.0


class SkipCounter:
    """Steps skipped for non-finite gradients; too many in a row stop the run with one line."""

    def __init__(self, limit: int, carried: bool = False) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.total = 0
        self.without_items_total = 0
        self.carried = carried   # a lossy compression carries part of earlier steps' gradients into each step
        self._empty = False

    def without_items(self, status: GradientStatus, step: int, report: bool) -> bool:
        """Whether `step`'s global batch had no items at all (every rank's num_items 0: a token-mean loss over
        sequences with no predicted token): there is no gradient to apply, so the optimizer, its weight
        decay and momentum, the schedulers and the loss scale stay as they are; logged on the first in a
        process. Under a lossy compression the step still carries what earlier steps left, and is applied."""
        self._empty = not status.found_inf and status.global_items <= 0 and not self.carried
        if self._empty:
            self.without_items_total += 1
            if report and self.without_items_total == 1:
                log.warning("step %d: its global batch had no items (num_items 0 on every rank): no update, the "
                            "schedulers and the loss scale stay as they are; session.step() returns False (logged "
                            "the first time)", step)
        return self._empty

    def count(self, applied: bool, step: int, loss_scale: float, report: bool, where: str = "") -> int:
        """Note whether `step` was applied; returns 1 for a step skipped for non-finite gradients, 0 otherwise
        (a step without items neither counts nor ends a run of skipped steps). `where`: whose loss was not
        finite (`GradientStatus.where()`)."""
        if self._empty:
            self._empty = False
            return 0
        if applied:
            self.in_a_row = 0
            return 0
        self.in_a_row += 1
        self.total += 1
        if report:
            log.warning("step %d skipped: non-finite gradients (%s; loss scale %g; %d skipped so far)",
                        step, where or "on some rank", loss_scale, self.total)
        if self.in_a_row >= self.limit:
            raise HetrainError(
                f"{self.in_a_row} steps in a row had non-finite gradients (up to step {step}"
                f"{'; ' + where if where else ''}): lower the learning "
                "rate, clip gradients, or check the data (a run that keeps checkpoints has the last good weights in "
                "its last one)"
            )
        return 1


def weighted_mean(value: torch.Tensor | float, weight: float, device: torch.device) -> float:
    """The mean over all ranks of each rank's `value`, weighted by its `weight` (collective); NaN when
    every weight is 0."""
    w = float(weight)
    if not w >= 0 or w == float("inf"):   # NaN too
        raise HetrainError(f"session.global_mean(weight={weight!r}): a weight is what this rank's value is a mean "
                           "over (its samples or tokens, 0 for none, 1 for a plain mean over ranks)")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise HetrainError(f"session.global_mean() takes one number per rank, got a tensor of {value.numel()} "
                           "elements; call it once per figure (or all-reduce a sum and a count yourself)")
    v = float(value.detach().item() if isinstance(value, torch.Tensor) else value)   # a float64 tensor stays exact
    t = torch.tensor([v * w if w else 0.0, w], dtype=torch.float64, device=device)
    with collective_call(None, "global_mean"):   # a rank that waits here alone is named with the call
        dist.all_reduce(t)
    return float(t[0] / t[1]) if t[1] > 0 else float("nan")


def total_norm(params: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, the same on every rank (sharded FSDP2 gradients included)."""
    norm = torch.nn.utils.get_total_norm(gradients(params), norm_type, error_if_nonfinite=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def clip_gradients(params: Sequence[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch's clip_grad_norm_ in two parts, so the norm of DTensor gradients is job-wide."""
    norm = total_norm(params, norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
