"""The prepared optimizer steps only inside `session.step()`.

The step's last `session.backward()` finishes the gradients at once: divided by the global batch's
item count, unscaled, checked for inf and NaN on every rank; so what a script does before
`session.step()` (torch's clipping, logging a norm) sees the global batch's final gradients. An
`optimizer.step()` of the user's own outside `session.step()` would skip the session's checks and
its bookkeeping (a gradient norm 13x the single process's was measured when gradients were still
unfinished), and one before `session.step()` would update twice. A step pre-hook refuses both with
one line. A step over zero gradients is let through: torch's distributed checkpoint takes one, at
learning rate 0, to create an optimizer's state before it is saved (`_init_optim_state`).

`zero_grad()` of the optimizer or the model, a habit of ported loops, is harmless between steps
(`session.step()` leaves no gradient), but between a step's micro-batches it discards the earlier
ones' gradients: the next `session.backward()` finds them gone (set to None or zeroed in place) and
refuses the step; so does torch's clipping there, which clips part of the step's gradient, and a
scheduler stepped after each micro-batch's `session.step()` (the learning rate moves mid-step). A
change to some gradients only (a mask on an embedding's rows) is the script's own and is kept. Under
FSDP2 each rank reads its own shards, which may be empty or all zero, and the ranks' verdicts travel
in one small all-reduce before each micro-batch but the first (every rank runs the job's count of
them). (Neither the optimizer nor the model is patched for it: a module with a function of
hetrain's among its attributes could no longer be pickled whole.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.gradients import has_non_finite

log = logging.getLogger("hetrain")

OUTSIDE_STEP = ("optimizer.step() was called outside session.step() (a GradScaler's scaler.step(optimizer) calls "
                "it: delete the GradScaler); call session.step() alone: it finishes "
                "the gradients over the global batch (item count, loss scale, inf check, clipping), then steps "
                "the optimizer and zeroes the gradients")


MID_STEP_ZERO = ("the gradients of this step's earlier micro-batches are gone (set to None or zeroed): a "
                 "zero_grad() between a step's micro-batches discards them; remove it (session.step() zeroes the "
                 "gradients after each step)")
MID_STEP_CLIP = ("the step's gradients were scaled between its micro-batches: torch.nn.utils.clip_grad_norm_ or "
                 "clip_grad_value_ (of the model, or of a parameter group) in a loop body that runs once per "
                 "micro-batch clips part of the step's gradient; call session.clip_grad_norm_(max_norm), which clips "
                 "the whole global-batch gradient once a step")
GONE_BEFORE_STEP = ("the step's gradients are gone between session.backward() and session.step() (zeroed or set to "
                    "None: an optimizer.zero_grad() there?), so the step would apply nothing; remove it "
                    "(session.step() zeroes the gradients after each step)")
BACKWARD_TWICE = ("session.backward() was called twice for one batch; add the losses and call it once: "
                  "session.backward(loss_a + loss_b) (a token mean beside a sample mean: docs/porting.md); to run a "
                  "rank's share in smaller pieces for memory, give its plan entry a micro_batch (hetrain runs the pieces); a step that "
                  "takes two gradients in turn (SAM) cannot be run by session.step() (docs/porting.md)")
MID_STEP_LR = ("the learning rate changed between the micro-batches of one step: a scheduler stepped after every "
               "session.step() call runs once per micro-batch (the loop body does), so its schedule runs that many "
               "times too fast; step it only when session.step() returns True, or give it to session.add_scheduler()")

class OptimizerStepGuard:
    """Refuses the optimizer's step unless `session.step()` is running it."""

    def __init__(self, optimizer: torch.optim.Optimizer, given: torch.optim.Optimizer | None = None,
                 model: torch.nn.Module | None = None) -> None:
        self.inside = False
        self.handle = optimizer.register_step_pre_hook(self._check)
        # the model given to prepare() (frozen parameters included, a pipeline's other stages too): what it made ready
        self._model = model
        self._known = {id(p) for p in (model.parameters() if model is not None else stepped_parameters(optimizer))}
        self._count = _count(optimizer)
        # the script's own optimizer where the session built another (ZeRO-1, FSDP2): a change to it goes nowhere
        self._given = given if given is not None and given is not optimizer else None
        # a tensor setting the rebuilt optimizer shares (an lr tensor) moves with it: not the script's change
        self._shared = {id(v) for g in optimizer.param_groups for v in g.values() if isinstance(v, torch.Tensor)}
        self._given_settings = plain_settings(self._given, self._shared) if self._given is not None else None

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer | None, given: torch.optim.Optimizer | None = None,
           model: torch.nn.Module | None = None) -> "OptimizerStepGuard | None":
        return cls(optimizer, given, model) if optimizer is not None else None

    @staticmethod
    def remove(guard: "OptimizerStepGuard | None") -> None:
        """The optimizer steps outside a session again (the session was closed)."""
        if guard is not None:
            guard.handle.remove()

    def _check(self, optimizer, args, kwargs) -> None:
        if not self.inside and _holds_gradients(optimizer):
            raise HetrainError(OUTSIDE_STEP)
        if self._given is not None:
            self._check_given()
        if self.inside and _count(optimizer) != self._count:   # optimizer.add_param_group since the last step
            self._check_known(optimizer)

    def _check_known(self, optimizer) -> None:
        new = [p for p in stepped_parameters(optimizer) if id(p) not in self._known]
        if new:
            names = {id(p): n for n, p in self._model.named_parameters()} if self._model is not None else {}
            which = ", ".join(names.get(id(p), f"a {tuple(p.shape)} tensor") for p in new[:3])
            raise HetrainError(
                f"the optimizer steps {len(new)} parameter(s) that were not in the model given to session.prepare() "
                f"({which}{', ...' if len(new) > 3 else ''}): a module or optimizer.add_param_group added after it. "
                "Their gradients are not all-reduced nor divided by the global batch's items (FSDP2 does not shard "
                "them), so each rank would train its own copy; build the whole model before session.prepare() "
                "(layers to train later frozen with requires_grad_(False), then unfrozen: docs/checkpoints.md)")
        self._count = _count(optimizer)

    def _check_given(self) -> None:
        now = plain_settings(self._given, self._shared)
        for i, (was, is_) in enumerate(zip(self._given_settings, now)):
            moved = sorted(k for k in set(was) | set(is_) if not _same(was.get(k), is_.get(k)))
            if moved:
                key = moved[0]
                raise HetrainError(
                    f"the optimizer given to session.prepare() changed after it ({key} of parameter group {i}: "
                    f"{was.get(key)!r} -> {is_.get(key)!r}: a scheduler built on it, or a value set by hand), but this "
                    "plan's sharding trains the optimizer prepare() returned, which did not change; build schedulers "
                    "on and set values in the returned one: model, optimizer = session.prepare(model, optimizer)")

    @contextmanager
    def allowed(self) -> Iterator[None]:
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def stepped_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter the optimizer steps, group by group."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(g["params"]) for g in optimizer.param_groups)


def plain_settings(optimizer: torch.optim.Optimizer, skip: set[int] = frozenset()) -> list[dict]:
    """Each parameter group's settings but its parameters (and tensors whose id is in `skip`)."""
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items()
             if k != "params" and id(v) not in skip} for g in optimizer.param_groups]


def _holds_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter the optimizer steps holds a gradient that is not zero (on this rank)."""
    return holds_gradients(stepped_parameters(optimizer), shard_counts=False)


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
    """The gradients stay as the last backward left them: between a step's micro-batches (not zeroed),
    and on a job with a loss scale until the session finishes them (not clipped by torch's function).
    A mask on some gradients (an embedding's rows zeroed) is the script's own and is kept: applied
    after every micro-batch it is the mask applied once.

    Gradients that are views of one buffer (DDP's buckets) share one in-place version counter, so a
    change is first noticed by the counters, then told apart by the gradients themselves: all zero
    (a zero_grad), or clipped (`clipped`: each tensor's norms against the ones the last backward left,
    kept after every backward but a step's last, and after the last on a loss-scaled job)."""

    def __init__(self) -> None:
        self._versions: dict[int, int] = {}
        self._norms: list[torch.Tensor] | None = None
        self._finished: dict[int, int] | None = None   # versions of the step's gradients when finished
        self._finished_held: torch.Tensor | None = None   # their largest magnitude, when the batch had items
        self._dropped_stale = False   # said once
        self._zeroed: set[int] | None = None   # ids of the parameters session.step() zeroed last

    def check(self, params: Sequence[torch.nn.Parameter], state, sharded_on: torch.device | None = None,
              optimizer: torch.optim.Optimizer | None = None) -> None:
        """Before a backward: a step whose earlier micro-batches ran backward still holds their gradients
        (not zeroed), not scaled down by a clipping. `sharded_on`: the gradients are this rank's FSDP2
        shards (some may be empty), and the ranks agree on the verdicts (collective, tensors on that device).
        Gradients the last backward left all zero (a first micro-batch without items) are not gone.
        `optimizer`: the one session.step() zeroes; a parameter it did not hold kept the last step's gradient."""
        if not state.between_micro_batches():
            self._versions, self._norms = {}, None
            # what the last step zeroed: the optimizer's parameters as of that step's first backward (one an
            # add_param_group since then takes held the gradient step() left it)
            held = None if optimizer is None else {id(p) for p in stepped_parameters(optimizer)}
            zeroed, self._zeroed = (held if self._zeroed is None else self._zeroed), held
            self._dropped_stale = drop_stale_gradients(params, not self._dropped_stale, zeroed) or self._dropped_stale
            return
        grads = gradients_of(params)
        left, self._norms = self._norms, None

        def had() -> bool:   # the last backward left a gradient that is not zero
            return left is not None and any(bool((n > 0).any()) for n in left)

        if sharded_on is None:   # replicated: every rank reads the same; the version counters say what changed
            changed = self._changed(grads)
            gone = not grads or (changed and not any(bool(g.any()) for g in grads) and had())
            scaled = changed and self._clipped_since(grads, left)
        else:   # FSDP2: an in-place change of a sharded gradient moves no version counter that can be read
            now = any(bool(g.any()) for g in grads)
            held, was, now, scaled = any_rank([bool(grads), had(), now, self._clipped_since(grads, left)],
                                             sharded_on)
            gone = not held or (was and not now)
        if gone:
            raise HetrainError(MID_STEP_ZERO)
        if scaled:
            raise HetrainError(MID_STEP_CLIP)

    def after_backward(self, params: Sequence[torch.nn.Parameter], last_micro: bool) -> None:
        """Note the gradients a backward left before the step's next micro-batch, where a check reads them
        (after the step's last one the session finishes them at once)."""
        if last_micro:
            self._versions, self._norms = {}, None
            return
        grads = gradients_of(params)
        self._versions = grad_versions(grads)
        self._norms = norms_of(grads) if grads else None

    def note_finished(self, params: Sequence[torch.nn.Parameter], with_items: bool = True) -> None:
        """The session finished the step's (replicated) gradients: their versions, to tell a later write, and
        whether the global batch had items (its gradients are then the step's, not nothing)."""
        grads = gradients_of(params)
        self._finished = grad_versions(grads)
        self._finished_held = None
        if with_items and grads:   # whether they held anything (a verdict read only if they are all zero at the step)
            if grads[0].device.type == "cpu":   # a look that stops at the first gradient holding something
                self._finished_held = torch.tensor(float(holds_gradients(params, shard_counts=False)))
            else:   # left on the device: no synchronisation here
                self._finished_held = torch.nn.utils.get_total_norm(grads, float("inf"))

    def broke_since_finish(self, params: Sequence[torch.nn.Parameter], device: torch.device,
                           sharding: str | None, skipped: bool = False) -> bool:
        """Whether a gradient became non-finite after the session finished them at the last backward (a
        hook's or the script's write on one rank), by `sharding` (None: a pipeline, which finishes them in
        step() itself). Replicated gradients are read again only where their version counters moved;
        under ZeRO-1, whose step is collective, the verdict is all-reduced (one scalar all-reduce each
        step); under DDP a rank that skips alone is told apart at the next step
        (`gradients.check_skips_agreed`). FSDP2's shards move no version counter that can be read, and
        no rank sees the others': every rank reads its shards and the verdict is all-reduced. A step that
        held gradients and has none left (a zero_grad() between backward and step) is refused, unless
        `skipped` (it is skipped anyway: non-finite)."""
        finished, self._finished = self._finished, None
        held, self._finished_held = self._finished_held, None
        if sharding is None:
            return False
        grads = gradients_of(params)
        if sharding == "fsdp":
            broke = has_non_finite(grads, device)
        else:
            moved = finished is not None and grad_versions(grads) != finished
            # all zero now (a NaN is not zero: such a step is skipped below), and they held something at finish
            if held is not None and not skipped and (not grads or moved) and \
                    not holds_gradients(params, shard_counts=False) and bool(held > 0):
                raise HetrainError(GONE_BEFORE_STEP)   # every rank alike: their gradients are one all-reduce's
            broke = moved and has_non_finite(grads, device)
        if sharding != "none":
            broke, = any_rank([broke], device)
        return broke

    def _clipped_since(self, grads: list[torch.Tensor], left: list[torch.Tensor] | None) -> bool:
        """Whether the gradients were clipped since the last backward left `left` (see `clipped`)."""
        if left is None or len(grads) != len(left):
            return False
        tol = max(1e-5, 4 * max(torch.finfo(g.dtype).eps for g in grads))   # a bf16 gradient's rounding
        return clipped(torch.stack(left), torch.stack(norms_of(grads)), grads, tol)

    def _changed(self, grads: list[torch.Tensor]) -> bool:
        return bool(self._versions) and grad_versions(grads) != self._versions


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag true on any rank, in one all-reduce every rank makes (a verdict no rank can reach alone,
    such as one on its own shards, that every rank must act on together)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in t.tolist()]


class SteadyLearningRate:
    """The learning rate stays put between a step's micro-batches (schedulers step after the update)."""

    def __init__(self) -> None:
        self._lrs: list | None = None   # at the step's earlier micro-batch, while it has more

    def check(self, optimizer: torch.optim.Optimizer, last_micro: bool) -> None:
        if last_micro and self._lrs is None:   # no micro-batches: nothing to compare
            return
        lrs = [g.get("lr") for g in optimizer.param_groups]
        lrs = [lr.detach().clone() if isinstance(lr, torch.Tensor) else lr for lr in lrs]
        if self._lrs is not None and not all(_same(a, b) for a, b in zip(self._lrs, lrs)):
            self._lrs = None
            raise HetrainError(MID_STEP_LR)
        self._lrs = None if last_micro else lrs


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not None and b is not None and torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def norms_of(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm, 1-norm, largest magnitude and count of non-zeros, left on its device (no
    synchronisation): what tells a clipping from a mask (`clipped`)."""
    # in float32 (a bf16 sum rounds), the count of non-zeros exact (a mask of a few in a large tensor shows)
    f32, f64 = torch.float32, torch.float64

    def stats(g: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(g.dtype, f32)   # float64 gradients stay float64
        largest = torch.linalg.vector_norm(g, float("inf"), dtype=dt) if g.numel() else g.new_zeros((), dtype=dt)
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=dt), torch.linalg.vector_norm(g, 1, dtype=dt), largest])
        return torch.cat([norms.to(f64), torch.count_nonzero(g).to(f64).reshape(1)])   # an empty shard's largest: 0

    return [stats(g) for g in grads]


def clipped(before: torch.Tensor, now: torch.Tensor, grads: list[torch.Tensor], tol: float = 1e-5) -> bool:
    """Whether `grads`, whose `norms_of` were `before` and are `now` ([tensors, 4]), were clipped: some changed,
    none lost a non-zero (a mask zeroes some), and either each changed one was scaled by one factor below 1
    (clip_grad_norm_ of the model or of a parameter group: its 2-norm, 1-norm and largest magnitude moved
    alike) or the changed ones were cut to one largest magnitude that no tensor exceeds, held by more than
    one value (clip_grad_value_ sets every value above it to it; an edit of one tensor, a projection or
    noise, leaves one largest value; a clip that cut one value alone is not told apart)."""
    changed = ((now - before).abs() > tol * before.abs().clamp(min=1e-30)).any(dim=1)
    if not bool(changed.any()) or bool((now[changed, 3] != before[changed, 3]).any()):
        return False
    b, n = before[changed, :3], now[changed, :3]
    if bool((b > 0).all()):
        ratios = n / b
        if bool((ratios < 1 - tol).all()) and bool((ratios > 0).all()) and \
                bool((ratios.max(dim=1).values - ratios.min(dim=1).values <= tol * ratios.max(dim=1).values).all()):
            return True
    cut = n[:, 2]
    if not (bool((cut < b[:, 2]).all()) and float(cut.max() - cut.min()) <= tol * float(cut.max())
            and bool((now[:, 2] <= cut.max() * (1 + tol)).all())):
        return False
    return sum(int((g.abs() == g.abs().max()).sum()) for g, c in zip(grads, changed.tolist()) if c and g.numel()) > 1


STALE = ("parameters held gradients at a step's first session.backward(), written after the last step (a "
         "loss.backward() outside the session, another model's backward through this one, as a GAN's generator loss "
         "through its discriminator): the step leaves them out, as optimizer.zero_grad() before it would (logged "
         "the first time)")


def drop_stale_gradients(params: Sequence[torch.nn.Parameter], warn: bool, zeroed: set[int] | None = None) -> bool:
    """Before a step's first backward: `session.step()` left no gradient, so any a parameter holds now was written
    outside the session's step and is not part of it (a plain PyTorch loop would add it to the step unless it
    called zero_grad()). Each rank drops its own (FSDP2: its shards); no collective. True when some were not zero.
    A trainable parameter the optimizer did not hold at the last step (`zeroed`: the ids it did) kept that step's
    gradient, which step() did not zero: dropped without a word."""
    held = [p for p in params if p.grad is not None]
    if zeroed is not None:
        for p in held:
            if id(p) not in zeroed:
                p.grad = None
        held = [p for p in held if id(p) in zeroed]
    if not held:
        return False
    grads = [g for g in gradients_of(held) if g.numel()]   # an FSDP2 shard may be empty
    nonzero = any(bool(torch.stack(torch._foreach_norm(group, float("inf"))).any()) for group in _by_device(grads))
    if nonzero and warn:
        log.warning("%s", STALE)
    for p in held:
        p.grad = None
    return nonzero


def _by_device(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device, []).append(g)
    return list(groups.values())


def gradients_of(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The gradients the parameters hold now (a sharded one: this rank's shard, the same tensor
    at every call: with grad mode on, `to_local()` returns a new view each time, whose identity the
    version check would take for a new gradient)."""
    with torch.no_grad():
        return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]


def grad_versions(grads: list[torch.Tensor]) -> dict[int, int]:
    """Each gradient tensor and its in-place version counter: changed by zero_(), mul_(), any in-place write.
    (torch offers the counter as `Tensor._version` only; torch.utils.checkpoint reads it the same way.)"""
    return {id(g): g._version for g in grads}


def check_reduced(comm_state, find_unused: bool = False) -> None:
    """Under DDP, the step's last backward went through DDP (its last gradient bucket was all-reduced).
    A forward through `model.module` (the unwrapped model) skips DDP: each rank would step on its own
    gradients, silently. `find_unused`: DDP's find_unused_parameters is on."""
    if comm_state is None or not hasattr(comm_state, "reduced"):
        return
    synced, comm_state.forward_synced = getattr(comm_state, "forward_synced", None), None
    if not comm_state.reduced and synced is False:
        raise HetrainError(
            "this step's gradients were not all-reduced: its last forward ran inside model.no_sync(); remove "
            "no_sync from the loop (hetrain runs the plan's micro-batches without syncing all but the last; "
            "to accumulate over more samples, raise global_batch_size)")
    if not comm_state.reduced and synced and find_unused:   # DDP traces a forward's outputs it can see
        raise HetrainError(
            "this step's gradients were not all-reduced: some parameters got no gradient in its backward, and "
            "find_unused_parameters=True found them only through the forward's outputs DDP sees (a tensor, or "
            "tensors in a dict, list, tuple or ModelOutput; not in a plain dataclass): return the outputs in a dict "
            "or tuple, or have every output take part in the loss")
    if not comm_state.reduced and synced:
        raise HetrainError(
            "this step's gradients were not all-reduced: some parameters got no gradient in its backward (a "
            "branch or head the forward did not use, or a parameter frozen after session.prepare()); pass "
            "session.prepare(model, optimizer, find_unused_parameters=True), as with DDP; a head whose loss goes "
            "to a second session.backward() of the batch: add the losses and call it once")
    if not comm_state.reduced:
        raise HetrainError(
            "this step's gradients were not all-reduced: its forward ran through the unwrapped model "
            "(model.module, or the model passed to session.prepare()) instead of the model session.prepare() "
            "returned; run training forwards through the returned model (model.module is for evaluation, "
            "generate() and saving)"
        )
    comm_state.reduced = False


_WARNED_EVALUATING: set[int] = set()


def warn_if_evaluating(model: torch.nn.Module, call: str = "session.backward()", *, blocks: bool = False) -> None:
    """Once per model: a training backward on a model left in eval mode (a loop's evaluation called
    model.eval() and no model.train() after it), where dropout and batch norm run as in evaluation.
    `blocks`: the model is a pipeline stage's list of the user's blocks, any of them in eval mode."""
    evaluating = any(not b.training for b in model.children()) if blocks else not model.training
    if evaluating and id(model) not in _WARNED_EVALUATING:
        _WARNED_EVALUATING.add(id(model))
        log.warning("%s on a model in eval mode: dropout and batch norm run as in evaluation; "
                    "call model.train() after evaluating", call)


_WARNED_TRAINING: set[int] = set()


def warn_if_training(model: torch.nn.Module) -> None:
    """Once per model: an evaluation on a model left in train mode, where dropout drops and batch norm
    updates its statistics (a loop's evaluation that did not call model.eval() first)."""
    if model.training and id(model) not in _WARNED_TRAINING:
        _WARNED_TRAINING.add(id(model))
        log.warning("session.evaluate() on a model in train mode: dropout and batch norm run as in training; "
                    "call model.eval() before evaluating and model.train() after")


@contextmanager
def quiet_step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """torch's distributed checkpoint creates an optimizer's empty state (SGD without momentum: always) with a step
    over zero gradients at learning rate 0 (`_init_optim_state`), at every save and load: the script's step hooks
    (an EMA updated in `register_step_post_hook`, as docs/checkpoints.md says) took it for an update, one more at
    every checkpoint. They are set aside for it (torch keeps them in the optimizer's own attributes)."""
    saved = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = type(saved[0])(), type(saved[1])()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = saved
