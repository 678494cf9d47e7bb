"""LR schedulers given to the session (`session.add_scheduler`): stepped with each update, checkpointed.

The session steps such a scheduler inside `session.step()`, right after an applied update (not after
a step skipped for non-finite gradients), and before that step's checkpoint. A checkpoint therefore
holds each scheduler where the next step needs it, and a resumed run, on any number of ranks,
follows the same schedule. A `ReduceLROnPlateau` steps on a metric only the script has: the script
keeps calling `scheduler.step(metric)`, and the session only checkpoints and restores it.

A scheduler may be given before or after `session.loader()` (which resumes the newest checkpoint):
given after, its saved state is loaded when it is given, and the optimizer's scheduled settings
(lr, momentum, betas), which building the scheduler reset to the schedule's start, return to the
checkpoint's.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch

from hetrain.checkpoint.errors import START_FROM_WEIGHTS
from hetrain.errors import HetrainError

log = logging.getLogger("hetrain")

# The optimizer settings a scheduler moves, restored from a checkpoint with the scheduler's state.
MOVED = ("lr", "momentum", "betas")
KIND = "hetrain_scheduler_class"   # the scheduler's class, saved beside its state
# A scheduler's state entries that move as it steps (or follow the optimizer's settings, base_lrs): the others
# are its arguments (T_max, step_size, gamma, milestones, ...), which a resume must give again as saved.
PROGRESS = frozenset({"last_epoch", "T_cur", "T_i", "best", "num_bad_epochs", "cooldown_counter", "base_lrs"})


COUNTER = "hetrain_counter"   # a collections.Counter in a scheduler's state (MultiStepLR's milestones), as a dict


def is_scheduler(obj: Any) -> bool:
    """Whether `obj` is one of torch's LR schedulers (ReduceLROnPlateau included)."""
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


def savable(state: Any) -> Any:
    """A state as a checkpoint holds it: a Counter (MultiStepLR's milestones, also inside a SequentialLR's or
    ChainedScheduler's states, or a script's own state), which checkpoints do not load (they load tensors and
    plain containers only), as a plain dict marked to become a Counter again. Containers without a Counter
    inside are the same objects."""
    if isinstance(state, collections.Counter):
        return {COUNTER: dict(state)}
    return _each(state, savable)


def loadable(state: Any) -> Any:
    """`savable`'s inverse: the state load_state_dict takes (a Counter answers 0 for a step that is no
    milestone, where a dict would raise)."""
    if isinstance(state, dict) and set(state) == {COUNTER}:
        return collections.Counter(state[COUNTER])
    return _each(state, loadable)


def _each(state: Any, convert: Callable[[Any], Any]) -> Any:
    """`state` with `convert` applied to each item of a dict, list or tuple: the same object where nothing
    changed, else one of its own type (an OrderedDict, a namedtuple) where that type can be built so."""
    if isinstance(state, dict):
        items = {k: convert(v) for k, v in state.items()}
        if all(items[k] is v for k, v in state.items()):
            return state
        try:
            return type(state)(items)
        except TypeError:   # a defaultdict, a dict subclass of other arguments
            return items
    if isinstance(state, (list, tuple)):
        converted = [convert(v) for v in state]
        if all(a is b for a, b in zip(converted, state)):
            return state
        if isinstance(state, tuple) and hasattr(state, "_fields"):   # a namedtuple
            return type(state)(*converted)
        try:
            return type(state)(converted)
        except TypeError:
            return list(converted) if isinstance(state, list) else tuple(converted)
    return state


def moved_settings(optimizer: Any) -> list[dict]:
    """Each parameter group's scheduled settings (lr, momentum, betas) as plain numbers and lists, as a checkpoint
    holds them (a tensor lr as its value)."""
    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else None
        if isinstance(v, (tuple, list)):
            items = [plain(x) for x in v]
            return None if any(x is None for x in items) else items
        return v if isinstance(v, (int, float)) else None

    out = []
    for group in optimizer.param_groups:
        values = {key: plain(group[key]) for key in MOVED if key in group}
        out.append({k: v for k, v in values.items() if v is not None})
    return out


def put_back(optimizer: Any, settings: list[dict]) -> None:
    """Set the optimizer's scheduled settings to `settings` (`moved_settings`' form, by parameter group): building a
    scheduler sets them to the schedule's start, and loading its state leaves them there."""
    for group, saved in zip(optimizer.param_groups, settings):
        for key in MOVED:
            if key not in group or key not in saved:
                continue
            mine, value = group[key], saved[key]
            if isinstance(mine, torch.Tensor):   # a tensor lr (capturable, fused): kept, its value set
                mine.fill_(value)
            elif isinstance(mine, tuple):
                group[key] = tuple(m.fill_(v) if isinstance(m, torch.Tensor) else v for m, v in zip(mine, value))
            else:
                group[key] = value


def position(scheduler: Any) -> Any:
    """How many steps the scheduler has taken: a ChainedScheduler's, those of the schedulers it chains (it
    counts none itself); None for one that counts none."""
    chained = getattr(scheduler, "_schedulers", None)
    if getattr(scheduler, "last_epoch", None) is None and isinstance(chained, (list, tuple)):
        return tuple(position(inner) for inner in chained)
    return getattr(scheduler, "last_epoch", None)


def on_metric(scheduler: Any) -> bool:
    """A scheduler stepped on a metric (ReduceLROnPlateau): the script steps it, the session only saves it."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class Schedulers:
    """The schedulers given to one session, in the order given (a checkpoint's states follow that order)."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._unmanaged_said = False
        self._stepped_to: list[Any] = []              # last_epoch after the session's own step, by scheduler
        self._saved: list[dict] | None = None         # a checkpoint's states not yet given a scheduler
        self._saved_settings: list[dict] = []         # that checkpoint's optimizer settings, by parameter group
        self._saved_step = 0
        self._start: list[list[dict]] = []              # each scheduler's starting settings, by parameter group

    def add(self, scheduler: Any, optimizer: Any) -> None:
        """Take `scheduler`, which must drive `optimizer` (the one session.prepare() returned)."""
        if optimizer is None:
            raise HetrainError("session.add_scheduler() needs the session's optimizer: call session.prepare(model, "
                               "optimizer) first and build the scheduler on the optimizer it returns")
        if not hasattr(scheduler, "state_dict") or not hasattr(scheduler, "step"):
            raise HetrainError(f"session.add_scheduler() takes an LR scheduler (torch.optim.lr_scheduler), "
                               f"not {type(scheduler).__name__}")
        if any(s is scheduler for s in self.items):
            raise HetrainError("this scheduler was already given to session.add_scheduler(); give each one once")
        if getattr(scheduler, "optimizer", None) is not optimizer:
            raise HetrainError(
                "this LR scheduler drives another optimizer than the one session.prepare() returned (the session "
                "may re-create the optimizer for its sharding); build the scheduler on the returned optimizer"
            )
        self.items.append(scheduler)
        self._stepped_to.append(position(scheduler))
        # the settings the schedule starts from (building it set them, and added its own: initial_lr, max_lr, ...):
        # a checkpoint without its state, whose optimizer groups replaced these, restarts it
        self._start.append([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])
        index = len(self.items) - 1
        if self._saved is not None:
            self._load(index, optimizer)

    def step(self, applied: bool) -> None:
        """At the end of a step: after an applied update, step every scheduler not stepped on a metric."""
        self.check_not_stepped_elsewhere()
        if self._saved is not None and len(self._saved) > len(self.items):   # said once, at the first step
            log.warning("the checkpoint of step %d holds the state of %d LR scheduler(s) and this run gave %d to "
                        "session.add_scheduler(): the learning rate of a schedule not given stays at the "
                        "checkpoint's", self._saved_step, len(self._saved), len(self.items))
            self._saved = self._saved[:len(self.items)]
        if not applied:
            return
        for i, scheduler in enumerate(self.items):
            if on_metric(scheduler):
                continue
            scheduler.step()
            self._stepped_to[i] = position(scheduler)

    def check_not_stepped_elsewhere(self, abandon: Callable[[], None] | None = None) -> None:
        """A loop that also calls scheduler.step() would advance the schedule twice a step: refused (said once:
        its schedule stays moved). `abandon`: drops the step's gradients (session.step() refuses it before the
        update; the loop, fixed, goes on with its next batch)."""
        for scheduler, expected in zip(self.items, self._stepped_to):
            if expected is not None and not on_metric(scheduler) and position(scheduler) != expected:
                self._stepped_to = [position(s) for s in self.items]
                if abandon is not None:
                    abandon()
                raise HetrainError(
                    f"{type(scheduler).__name__}.step() was called outside session.step(); the session steps "
                    "the schedulers given to session.add_scheduler() after each update: remove the loop's own "
                    "scheduler.step()"
                )

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self, optimizer: Any = None, *, saved_by_script: bool = False) -> list[dict]:
        """Each scheduler's state, with its class's name (a resume compares it). A scheduler drives `optimizer`
        (building one sets each group's initial_lr) and none was given to the session, nor saved as a state of
        the script's own (`saved_by_script`, a schedule stepped once an epoch): said once."""
        self.check_not_stepped_elsewhere()
        if not self.items and not saved_by_script and not self._unmanaged_said and optimizer is not None and any(
                "initial_lr" in g for g in optimizer.param_groups):
            self._unmanaged_said = True
            log.warning("an LR scheduler drives the optimizer and none was given to session.add_scheduler(): the "
                        "checkpoint holds no schedule position, and a resume starts the schedule from its beginning; "
                        "give it to session.add_scheduler(scheduler), which steps it after each update and saves it, "
                        "or, to step it yourself (once an epoch), to session.add_state(\"lr_schedule\", scheduler), "
                        "which saves it")
        return [{**savable(scheduler.state_dict()), KIND: type(scheduler).__name__} for scheduler in self.items]

    def load_state_dict(self, states: list[dict] | None, settings: list[dict] | None, step: int,
                        optimizer: Any) -> None:
        """A checkpoint's states (None: it holds none): loaded now into the schedulers given so far, and
        into later ones when they are given."""
        self._saved, self._saved_settings, self._saved_step = list(states or []), list(settings or []), step
        for i in range(len(self.items)):
            self._load(i, optimizer)

    def _load(self, index: int, optimizer: Any) -> None:
        scheduler = self.items[index]
        if index >= len(self._saved):
            if self._saved_step > 0:
                log.warning("the checkpoint of step %d holds no state for LR scheduler %d (%s): it starts from "
                            "its beginning", self._saved_step, index, type(scheduler).__name__)
                for group, start in zip(optimizer.param_groups, self._start[index]):
                    for key, value in start.items():   # the scheduled ones as at its start; its own, where gone
                        group[key] = value if key in MOVED else group.get(key, value)
            return
        saved, own, name = loadable(self._saved[index]), scheduler.state_dict(), type(scheduler).__name__
        kind = saved.pop(KIND, None)   # None in a checkpoint written before kinds were saved
        missing = sorted(k for k in own if k not in saved and not k.startswith("_") and k != KIND)
        if (kind is not None and kind != name) or missing:
            what = f"a {kind}" if kind not in (None, name) else (
                f"a {name} built with other arguments" if kind == name else f"another kind of scheduler than {name}")
            raise HetrainError(
                f"the checkpoint of step {self._saved_step} holds LR scheduler {index}'s state for {what}"
                + (f" (it lacks {', '.join(missing[:3])})" if missing and kind in (None, name) else "")
                + f", and this run gives {name}: give the scheduler the checkpoint was saved with, or "
                f"{START_FROM_WEIGHTS}")
        changed = [k for k in own if k in saved and not k.startswith("_") and k not in PROGRESS and own[k] != saved[k]]
        if changed:   # loading the state would put the checkpoint's arguments back, silently
            detail = ", ".join(f"{k}: checkpoint {saved[k]!r}, this run {own[k]!r}" for k in changed[:3])
            raise HetrainError(
                f"the checkpoint of step {self._saved_step} holds LR scheduler {index}'s state for a {name} built with "
                f"other arguments ({detail}): resuming would go on with the checkpoint's; build it with those, or "
                f"{START_FROM_WEIGHTS}")
        scheduler.load_state_dict(saved)
        self._stepped_to[index] = position(scheduler)
        # Building the scheduler moved the optimizer's settings to the schedule's start: back to the checkpoint's.
        put_back(optimizer, self._saved_settings)
