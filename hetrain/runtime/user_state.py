"""The script's own state, saved in every checkpoint and restored on resume (`session.add_state`).

An EMA of the weights (`torch.optim.swa_utils.AveragedModel`), a metric tracker, a best value: anything
with `state_dict()` and `load_state_dict()`, or a plain dict (saved as it is, restored in place: its
tensors are copied into the ones it holds, which a hook may hold too). The checkpoint holds rank 0's, so
such state must be the same on every rank (as anything derived from the replicated weights and the
global-batch loss is).

A checkpoint is written inside `session.step()`, right after the update: state the script changes
after `step()` returns is saved one step behind. Change it with the update instead, from a hook on the
optimizer `prepare()` returned: `optimizer.register_step_post_hook(lambda *_: ema.update_parameters(net))`
runs right after every applied update and before that step's checkpoint.

State may be given before or after `session.loader()` (which resumes the newest checkpoint): given
after, its saved state is loaded when it is given. An LR scheduler the script steps itself (once an epoch) is
saved with its optimizer's scheduled settings (lr, momentum, betas) and puts them back when loaded: one built
after `session.loader()` set them to the schedule's start, and its state alone leaves them there (a LambdaLR
resumed in its third epoch said 0.7 and the optimizer ran at 1.0).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from hetrain.checkpoint.safe_io import check_savable
from hetrain.errors import HetrainError
from hetrain.runtime.batch_tree import tensors
from hetrain.runtime.schedulers import is_scheduler, loadable, moved_settings, put_back, savable

log = logging.getLogger("hetrain")

SETTINGS = "hetrain_optimizer_settings"   # beside a scheduler's state: its optimizer's scheduled settings


def _check(name: Any, obj: Any) -> None:
    if not isinstance(name, str) or not name:
        raise HetrainError(f"session.add_state(name, obj): name must be a non-empty string, got {name!r}")
    if isinstance(obj, dict):
        return
    if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
        raise HetrainError(
            f"session.add_state({name!r}, ...) takes an object with state_dict() and load_state_dict() (a module, "
            f"an AveragedModel, a metric) or a dict, not {type(obj).__name__}")


def _sharded(name: str) -> HetrainError:
    return HetrainError(
        f"the state given to session.add_state({name!r}) holds sharded tensors (DTensor, FSDP2's shards): a "
        "checkpoint holds one copy of the script's state, rank 0's; keep full tensors there, the same on every rank")


def _digest(name: str, value: Any) -> Any:
    """A fingerprint of a state to compare across ranks: tensors by shape and the integer sum of their words,
    other values as they are."""
    sums: list[torch.Tensor] = []

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if hasattr(v, "to_local"):
                raise _sharded(name)
            # an integer sum of the raw words: the same on every rank however its threads add (a float sum
            # of identical values differed between 1 and 2 threads)
            words = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(v.element_size(), torch.int8)
            flat = v.detach().contiguous().reshape(-1)
            sums.append(flat.view(words).sum(dtype=torch.int64).cpu() if v.numel()
                        else torch.zeros((), dtype=torch.int64))
            return ("tensor", tuple(v.shape), len(sums) - 1)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return repr(v)

    shape = walk(value)
    return shape, torch.stack(sums).tolist() if sums else []


class UserStates:
    """The named states given to one session, and a checkpoint's states not yet given an object."""

    def __init__(self) -> None:
        self.items: dict[str, Any] = {}
        self._saved: dict[str, Any] | None = None   # a restored checkpoint's states, by name, not yet loaded
        self.protected: Callable[[], list[torch.Tensor]] = list   # tensors a restore never writes into (the model's)

    def add(self, name: str, obj: Any) -> None:
        _check(name, obj)
        # a value no checkpoint could hold (a NumPy scalar, a set, an object) refused now, not at the first save
        state = savable(dict(obj) if isinstance(obj, dict) else obj.state_dict())
        if any(hasattr(t, "to_local") for t in tensors(state)):   # an EMA of FSDP2's shards
            raise _sharded(name)
        check_savable(state, where=f"session.add_state({name!r})")
        if name in self.items:
            raise HetrainError(f"a state named {name!r} was already given to session.add_state(); give each once")
        self.items[name] = obj
        if self._saved is not None:
            self._load(name, obj)

    def state_dict(self) -> dict[str, Any]:
        # savable: a Counter (a MultiStepLR's milestones, a scheduler stepped by the script once an epoch)
        return {name: _state(obj) for name, obj in self.items.items()}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """A checkpoint's states: loaded into the objects given so far, kept for those given later."""
        self._saved = dict(saved or {})
        for name, obj in self.items.items():
            self._load(name, obj)

    def check_replicated(self, states: dict[str, Any], world_size: int) -> None:
        """Refuse states that differ between ranks (collective): a checkpoint holds one copy, rank 0's, so
        a rank holding its own part (an EMA of FSDP2's local shards) would resume with rank 0's."""
        if world_size == 1 or not states:
            return
        import torch.distributed as dist

        mine = {name: _digest(name, value) for name, value in states.items()}
        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, mine)
        for name in states:
            differ = [r for r, d in enumerate(every) if d[name] != every[0][name]]
            if differ:
                raise HetrainError(
                    f"the state given to session.add_state({name!r}) differs between ranks (rank 0 and rank "
                    f"{differ[0]}), and a checkpoint holds one copy of it, rank 0's: every rank would resume with "
                    "rank 0's; keep it the same on every rank (derived from the whole model and the global-batch "
                    "loss), or save a rank's own part yourself")

    def _load(self, name: str, obj: Any) -> None:
        if name not in self._saved:
            log.warning("the checkpoint resumed holds no state named %r (session.add_state): it starts as the "
                        "script built it", name)
            return
        value = loadable(self._saved.pop(name))
        if isinstance(obj, dict):
            shared = _aliased(tensors(obj), self.protected())
            restored = {k: _restored(obj.get(k), v, shared) for k, v in value.items()}
            obj.clear()
            obj.update(restored)
        elif is_scheduler(obj) and isinstance(value, dict) and SETTINGS in value:
            value = dict(value)
            settings = value.pop(SETTINGS)
            obj.load_state_dict(value)
            put_back(obj.optimizer, settings)
        else:
            obj.load_state_dict(value)


def _state(obj: Any) -> Any:
    """A given state as a checkpoint holds it; a scheduler's with its optimizer's scheduled settings."""
    if isinstance(obj, dict):
        return savable(dict(obj))
    state = savable(obj.state_dict())
    if is_scheduler(obj) and isinstance(state, dict) and getattr(obj, "optimizer", None) is not None:
        state = {**state, SETTINGS: moved_settings(obj.optimizer)}
    return state


def _aliased(state: list[torch.Tensor], protected: list[torch.Tensor]) -> set[int]:
    """The ids of the state's tensors whose memory overlaps another of the state's (one tensor under two keys) or
    one of `protected` (the model's: `net.state_dict()` holds views of its weights). Views of one buffer that do
    not overlap (a flat EMA's parts) are each their own."""
    spans: dict[int, list[tuple[int, int, int | None]]] = {}
    for i, t in enumerate([*state, *protected]):
        local = t.to_local() if hasattr(t, "to_local") else t   # FSDP2's DTensor parameters: their shard
        try:
            ptr = local.untyped_storage().data_ptr()
        except RuntimeError:   # a tensor without storage of its own to read
            continue
        start = local.storage_offset() * local.element_size()   # to one past its last element, whatever its strides
        end = start + (sum((n - 1) * abs(st) for n, st in zip(local.shape, local.stride())) + 1) * local.element_size()
        if local.numel():
            spans.setdefault(ptr, []).append((start, end, id(t) if i < len(state) else None))
    aliased: set[int] = set()
    for held in spans.values():
        for a, (start, end, owner) in enumerate(held):
            if any(s < end and start < e for b, (s, e, _) in enumerate(held) if b != a) and owner is not None:
                aliased.add(owner)
    return aliased


def _restored(mine: Any, saved: Any, shared: set[int]) -> Any:
    """A saved value put back where the script's dict holds one. A tensor of its own (the same shape and dtype,
    one block of memory that no other tensor of the state or of the model overlaps) is copied into in place, as a
    module's load_state_dict does: a hook updating an EMA's tensors (`torch._foreach_lerp_`) holds them, and
    went on updating tensors the dict no longer held. Any other is replaced by the saved one (a placeholder of
    the model's weights, `net.state_dict()`, must not take a best model's values), on the script's device; a
    list or dict of them likewise; anything else is the saved value."""
    if isinstance(saved, torch.Tensor) and isinstance(mine, torch.Tensor):
        own = mine.shape == saved.shape and mine.dtype == saved.dtype and mine.is_contiguous() and \
            not mine.is_inference() and id(mine) not in shared
        if own:
            with torch.no_grad():
                return mine.copy_(saved)
        return saved.to(mine.device)
    if isinstance(saved, dict) and isinstance(mine, dict):
        restored = {k: _restored(mine.get(k), v, shared) for k, v in saved.items()}
        mine.clear()
        mine.update(restored)
        return mine
    if isinstance(saved, list) and isinstance(mine, list) and len(saved) == len(mine):
        mine[:] = [_restored(m, v, shared) for m, v in zip(mine, saved)]
        return mine
    return copy.deepcopy(saved)
