"""The checkpointable state of a session, as one object: what a checkpoint holds and how it returns.

Model, optimizer, the LR schedulers and the script's own states given to the session, job-wide loss scale, balancer (split and
measurements), data position, step, plan, and every rank's RNG state (docs/design.md, invariant 5). Under ZeRO-1 the optimizer state is
consolidated on rank 0 and saved whole (it loads on any number of ranks); under FSDP2 model and
optimizer go through `torch.distributed.checkpoint.state_dict` into the checkpoint's sharded part.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from hetrain.checkpoint.errors import START_FROM_WEIGHTS
from hetrain.checkpoint.rng import capture_rng, restore_rng
from hetrain.errors import HetrainError
from hetrain.planning.plan import Plan
from hetrain.runtime.balance_config import saved_split_outside
from hetrain.runtime.balancer import Balancer
from hetrain.runtime.gradients import local_tensor
from hetrain.runtime.data import HeteroLoader
from hetrain.runtime.parallelize import Prepared
from hetrain.runtime.precision import JobLossScaler
from hetrain.runtime.schedulers import MOVED, Schedulers, is_scheduler
from hetrain.runtime.sharding import is_zero1
from hetrain.runtime.step_guard import any_rank, quiet_step_hooks
from hetrain.runtime.step_state import StepState
from hetrain.runtime.user_state import UserStates

log = logging.getLogger("hetrain")

NON_FINITE = ("{what} holds NaN or inf at step {step}; no checkpoint is written with it (the last good checkpoint "
              "stays): lower the learning rate or clip gradients")

# Optimizer settings that a schedule moves during training: a checkpoint's values are expected to differ.
SCHEDULED = {*MOVED, "initial_lr"}
# How torch's optimizers run a step, not what it computes: a resume keeps the script's (fused=True added later).
HOW_STEPPED = ("foreach", "fused", "capturable", "differentiable")
# Settings that decide which state torch's optimizers keep (Adam's max_exp_avg_sq, RMSprop's grad_avg, a momentum
# buffer or none).
STATE_KINDS = ("amsgrad", "centered", "momentum")


def _kind_differs(key: str, saved: Any, script: Any) -> bool:
    return (saved == 0) != (script == 0) if key == "momentum" else saved != script


@dataclass
class TrainState:
    """Everything needed to continue a run exactly; `step` is the number of finished steps."""

    prepared: Prepared
    sharding: str
    scaler: JobLossScaler
    balancer: Balancer
    loader: HeteroLoader
    plan: Plan | None
    world_size: int
    rank: int
    schedulers: Schedulers = field(default_factory=Schedulers)
    user_states: UserStates = field(default_factory=UserStates)
    step_state: StepState | None = None   # its items per sample weight the next step's backward
    step: int = 0
    skipped_steps: int = 0
    device: torch.device = torch.device("cpu")   # the session's: where its collectives take their tensors

    def __post_init__(self) -> None:
        # a dict of the script's state restores into the tensors it holds, never into the model's own
        self.user_states.protected = lambda: [*self.prepared.state_module.parameters(),
                                              *self.prepared.state_module.buffers()]

    @property
    def pipelined(self) -> bool:
        """A pipeline plan: each rank holds one stage's blocks, under the whole model's names."""
        return self.plan is not None and self.plan.pipeline is not None

    @property
    def fsdp(self) -> bool:
        """Model and optimizer state go through the checkpoint's sharded part (DCP): FSDP2 or pipeline stages."""
        return self.sharding == "fsdp" or self.pipelined

    def capture(self, names_with_state: Sequence[str] | None = None, *,
                in_step: bool = False) -> tuple[dict, dict, dict | None]:
        """(shared, per_rank, sharded) as of now (collective under ZeRO-1 and FSDP2). Under FSDP2 the
        optimizer state of every parameter that has some, frozen now or not (torch's state dicts leave
        frozen ones out); `names_with_state`: a checkpoint's such parameters, for a template. `in_step`: taken
        inside `session.step()`, before the script's code after it (the loader's state says so)."""
        model, optimizer = self.prepared.model, self.prepared.optimizer
        # No checkpoint stores non-finite weights. Under FSDP2 and pipelines a rank's are its own shard or stage:
        # every rank learns of another's in one all-reduce, with whether any rank's optimizer holds state yet
        # (none: no update applied, and what DCP's template step gives it is no state of its own).
        bad = self.non_finite()
        unstepped = False
        if self.fsdp:
            has_state, bad_elsewhere = any_rank([optimizer is not None and any(optimizer.state.values()),
                                                 bad is not None], self.device)
            unstepped = not has_state
            bad = bad or (NON_FINITE.format(what="a parameter of another rank", step=self.step) if bad_elsewhere
                          else None)
        if bad is not None:
            raise HetrainError(bad)
        with_state = state_names(self.prepared.state_module, optimizer) if self.sharding == "fsdp" else []
        sharded = None
        model_state = optimizer_state = None
        if self.pipelined:
            sharded = stage_state(self.prepared.module, optimizer)
        elif self.fsdp:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            sharded = {"model": get_model_state_dict(model)}
            if optimizer is not None:  # a fresh optimizer's state is initialised first, as a template
                with trainable(self.prepared.state_module, with_state if names_with_state is None else names_with_state):
                    with as_it_was(optimizer):
                        sharded["optimizer"] = get_optimizer_state_dict(model, optimizer)
        else:
            model_state = self.prepared.state_module.state_dict()
            optimizer_state = self._full_optimizer_state()
        user_state = self.user_states.state_dict()
        self.user_states.check_replicated(user_state, self.world_size)
        shared = {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "model": model_state,
            "optimizer": optimizer_state,
            "optimizer_class": _optimizer_class(optimizer),
            "optimizer_state_names": with_state,
            # no rank's optimizer has state yet (no update applied): what DCP's template step gave it is none
            "optimizer_unstepped": unstepped,
            # FSDP2: a resume compares them with its model's (the sharded load reads only the keys it has)
            "model_keys": sorted(sharded["model"]) if self.fsdp and not self.pipelined else None,
            "optimizer_settings": _settings(optimizer),
            "sharding": self.sharding,
            "scaler": self.scaler.state_dict(),
            "items_per_sample": self.step_state.items_per_sample if self.step_state is not None else None,
            "loss": self.step_state.last_loss if self.step_state is not None else None,   # session.loss on resume
            "schedulers": self.schedulers.state_dict(
                optimizer, saved_by_script=any(is_scheduler(obj) for obj in self.user_states.items.values())),
            "user_state": user_state,
            "balancer": self.balancer.state_dict(),
            "loader": self.loader.state_dict(in_step=in_step),
            "world_size": self.world_size,
            "plan": self.plan.to_json() if self.plan is not None else "",
        }
        return shared, {"rng": capture_rng(), "balancer": self.balancer.local_state_dict()}, sharded

    def sharded_template(self, shared: dict | None = None) -> dict | None:
        """The sharded state's shapes, for DCP to load into (FSDP2 only): with the checkpoint's `shared`
        state, optimizer state for every parameter it holds state for, frozen now or not (torch's
        template and load leave out frozen parameters: a backbone unfrozen mid-run lost its state)."""
        return self.capture((shared or {}).get("optimizer_state_names", []))[2] if self.fsdp else None

    def restore(self, shared: dict, per_rank: dict | None, sharded: dict | None, where: str) -> None:
        """Load a checkpoint's state into this run (every rank, same checkpoint)."""
        model, optimizer = self.prepared.model, self.prepared.optimizer
        self._check_optimizer(shared, where)
        for saved in ((sharded or {}).get("optimizer"), shared.get("optimizer")):
            keep_how_stepped(saved, optimizer)
        try:
            if self.pipelined:
                load_stage_state(self.prepared.module, optimizer, sharded)
            elif self.fsdp:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

                set_model_state_dict(model, sharded["model"])
                if optimizer is not None:
                    with trainable(self.prepared.state_module, shared.get("optimizer_state_names", ())):
                        with quiet_step_hooks(optimizer):
                            set_optimizer_state_dict(model, optimizer, sharded["optimizer"])
            else:
                # a checkpoint saved before compiled models were saved by the plain model's names
                consume_prefix_in_state_dict_if_present(shared["model"], "_orig_mod.")
                self.prepared.state_module.load_state_dict(shared["model"])
                if shared["optimizer"] is not None and optimizer is not None:
                    if is_zero1(optimizer):
                        from hetrain.runtime.zero1 import load_zero1_state

                        load_zero1_state(optimizer, shared["optimizer"])
                    else:
                        optimizer.load_state_dict(shared["optimizer"])
            if (self.pipelined or self.fsdp) and shared.get("optimizer_unstepped") and optimizer is not None:
                optimizer.state.clear()   # saved before its first update: the loaded state is DCP's template step's
        except (RuntimeError, KeyError, ValueError) as e:
            raise HetrainError(
                f"{where} was saved from a different model or optimizer ({load_error_summary(e)}); resume with the model "
                f"and optimizer it was saved with, or {START_FROM_WEIGHTS}"
            ) from None
        self.scaler.load_state_dict(shared["scaler"])
        self.loader.load_state_dict(shared["loader"])
        self.step = int(shared["step"])
        self.schedulers.load_state_dict(shared.get("schedulers"), shared.get("optimizer_settings"), self.step,
                                        optimizer)
        self.skipped_steps = int(shared.get("skipped_steps", 0))
        self.user_states.load_state_dict(shared.get("user_state"))
        if self.step_state is not None:
            self.step_state.resumed_loss = shared.get("loss")
        if self.step_state is not None and shared.get("items_per_sample") is not None:
            self.step_state.items_per_sample = float(shared["items_per_sample"])
        if int(shared["world_size"]) == self.world_size:
            # (a plan whose own split breaks its bounds, as balancing off allows, keeps the saved one as before)
            outside = (saved_split_outside(shared["balancer"]["shares"], self.balancer.config)
                       if saved_split_outside(self.balancer.shares, self.balancer.config) is None else None)
            if outside is None and self.balancer.load_state_dict(shared["balancer"]):   # rank 0's; own times apart
                self.balancer.load_local_state_dict(per_rank.get("balancer") if per_rank is not None else None)
            else:
                self.loader.start_split_anew()
                why = outside or (f"the ranks are on other devices than the checkpoint's ({self.balancer.devices}, "
                                  f"was {shared['balancer'].get('devices')})")
                if self.rank == 0:
                    log.warning("resuming where %s: the split starts from this run's plan and is measured anew", why)
        if per_rank is not None:
            restore_rng(per_rank["rng"])

    def check_model_keys(self, shared: dict, where: str) -> None:
        """FSDP2: the checkpoint's model keys are this model's. Its sharded load reads the keys this model has:
        one the checkpoint lacks failed in the load, and one only the checkpoint has was left, silently."""
        saved = shared.get("model_keys")
        if not self.fsdp or self.pipelined or saved is None:   # a checkpoint from before the keys were saved
            return
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        mine = set(get_model_state_dict(self.prepared.model))
        extra, missing = sorted(set(saved) - mine), sorted(mine - set(saved))
        if extra or missing:
            parts = ([f"only the checkpoint has {', '.join(extra[:4])}"] if extra else []) + (
                [f"only this model has {', '.join(missing[:4])}"] if missing else [])
            raise HetrainError(
                f"{where} was saved from a different model ({'; '.join(parts)}); resume with the model it was saved "
                f"with, or {START_FROM_WEIGHTS}")

    def non_finite(self) -> str | None:
        """Why no checkpoint is written with this rank's weights (one holds NaN or inf), or None."""
        for name, p in self.prepared.state_module.named_parameters():
            local = local_tensor(p)
            if local.numel() and not bool(torch.isfinite(local.detach()).all()):
                return NON_FINITE.format(what=f"parameter {name}", step=self.step)
        return None

    def _full_optimizer_state(self) -> dict | None:
        optimizer = self.prepared.optimizer
        if optimizer is None:
            return None
        if is_zero1(optimizer):
            # ZeRO's full state dict is keyed by global parameter index: it loads on any number of ranks
            optimizer.consolidate_state_dict(to=0)
            return optimizer.state_dict() if self.rank == 0 else None
        return optimizer.state_dict()

    def _check_optimizer(self, shared: dict, where: str) -> None:
        optimizer = self.prepared.optimizer
        saved = shared.get("optimizer_class")
        if optimizer is None or saved is None:
            return
        mine = _optimizer_class(optimizer)
        if saved != mine:
            raise HetrainError(
                f"{where} holds the state of a {saved} optimizer, this script builds {mine}; resume with the "
                f"optimizer it was saved with, or {START_FROM_WEIGHTS}"
            )
        theirs, ours = shared.get("optimizer_settings") or [], _settings(optimizer)
        if theirs and len(theirs) != len(ours):
            raise HetrainError(
                f"{where} holds an optimizer of {len(theirs)} parameter groups and this script's has {len(ours)} "
                "when it resumes (at session.loader()): build it with the groups it was saved with (one the run "
                "added with optimizer.add_param_group must be there from the start, its parameters frozen with "
                f"requires_grad=False until they train: docs/checkpoints.md), or {START_FROM_WEIGHTS}")
        changed = replaced_settings(theirs, ours, scheduled=bool(shared.get("schedulers")))
        for i, (a, b) in enumerate(zip(theirs, ours)):
            kinds = [k for k in STATE_KINDS if k in a and k in b and _kind_differs(k, a[k], b[k])
                     and not (k == "momentum" and "base_momentum" in a)]   # one a schedule cycles, to 0 maybe
            if kinds and self.fsdp:   # a sharded load (FSDP2, pipelines) reads the state the script's settings make
                detail = ", ".join(f"{k}: checkpoint {a[k]!r}, script {b[k]!r}" for k in kinds)
                raise HetrainError(
                    f"{where}: parameter group {i} of the optimizer keeps other state than the checkpoint's ({detail}), "
                    f"and a sharded checkpoint is read into the state the script's optimizer keeps; build it with the "
                    f"checkpoint's settings, or {START_FROM_WEIGHTS}")
            # keys only one side has are a scheduler's own (max_lr, base_momentum, ...), set when it is built; the
            # others (a weight decay the script schedules by hand) go on as the checkpoint has them, as lr does
            changed += [f"group {i} {k}: checkpoint {a[k]!r}, script {b[k]!r}" for k in sorted(set(a) & set(b))
                        if k not in SCHEDULED and k not in HOW_STEPPED and not _same(a[k], b[k])]
        if changed and self.rank == 0:
            log.warning("%s holds other optimizer settings than this script builds (%s): the checkpoint's go on, as "
                        "optimizer.load_state_dict() does (a schedule's position is among them); to train on with "
                        "the script's, set them after session.loader(), e.g. for g in optimizer.param_groups: "
                        "g['lr'] = ...", where, "; ".join(changed))


def _optimizer_class(optimizer: Any) -> str | None:
    if optimizer is None:
        return None
    inner = optimizer.optim if is_zero1(optimizer) else optimizer
    return type(inner).__name__


def _settings(optimizer: Any) -> list[dict]:
    """Each parameter group's plain settings (numbers, flags, tuples), for comparison on resume."""
    if optimizer is None:
        return []
    out = []
    for group in optimizer.param_groups:
        out.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                    if k != "params" and isinstance(v, (bool, int, float, str, tuple, list, type(None)))})
    return out


def replaced_settings(saved: list[dict], script: list[dict], scheduled: bool = False) -> list[str]:
    """The scheduled settings (lr, momentum, betas) a resume replaces with other values, as 'group 0 lr: checkpoint
    0.01, script 0.001'. A schedule moves them, so where one ran (its initial_lr saved) the lr it started from is
    compared, and only with the start of the script's schedule, built before session.loader() (one given after it
    may set its own start: OneCycleLR's max_lr / div_factor); a momentum it cycles (base_momentum saved) is not.
    `scheduled`: the checkpoint holds a scheduler's state, and one that keeps no start (ReduceLROnPlateau) moved
    the lr where it is: not compared."""
    out = []
    for i, (a, b) in enumerate(zip(saved, script)):
        pairs = []
        if "initial_lr" not in a and not scheduled:
            pairs.append(("lr", a.get("lr"), b.get("lr")))
        elif "initial_lr" in a and "initial_lr" in b:
            pairs.append(("lr", a["initial_lr"], b["initial_lr"]))
        if "base_momentum" not in a:
            pairs += [(k, a.get(k), b.get(k)) for k in ("momentum", "betas")]
        out += [f"group {i} {k}: checkpoint {x!r}, script {y!r}" for k, x, y in pairs
                if x is not None and y is not None and not _same(x, y)]
    return out


def keep_how_stepped(saved: dict | None, optimizer: Any) -> None:
    """The script's `HOW_STEPPED` flags written into an optimizer state dict before it loads (its param groups, or
    a flattened dict's `param_groups.<name>.<key>`), so that the load casts the state for them (a fused step's
    counter on the device) and they stay the script's."""
    if not isinstance(saved, dict) or optimizer is None:
        return
    mine = [{k: g[k] for k in HOW_STEPPED if k in g} for g in optimizer.param_groups]
    groups = saved.get("param_groups")
    if isinstance(groups, list):
        for group, flags in zip(groups, mine):
            group.update({k: v for k, v in flags.items() if k in group})
        return
    for key in saved:   # flattened (a pipeline stage's): the flags are the optimizer's, the same in every group
        name = key.rsplit(".", 1)[-1] if key.startswith("param_groups.") else None
        if name in HOW_STEPPED and mine and name in mine[0]:
            saved[key] = mine[0][name]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def state_names(model: torch.nn.Module, optimizer: Any) -> list[str]:
    """The names of the parameters the optimizer holds state for."""
    if optimizer is None:
        return []
    return [name for name, p in model.named_parameters() if p in optimizer.state]


@contextlib.contextmanager
def trainable(model: torch.nn.Module, names: Sequence[str]) -> Iterator[None]:
    """These parameters (by the plain model's names) marked trainable for a while (torch's optimizer state dicts
    leave frozen ones out)."""
    wanted = {name.removeprefix("_orig_mod.") for name in names}   # a compiled model's, saved before plain names
    frozen = [p for name, p in model.named_parameters() if name in wanted and not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


@contextlib.contextmanager
def as_it_was(optimizer: Any) -> Iterator[None]:
    """Around torch's `get_optimizer_state_dict`, which gives an optimizer without state its state by a step over
    zero gradients at learning rate 0 (`_init_optim_state`): Adam's step count became 1 before its first update,
    which was then bias-corrected as a second (0.744 of it) and every later one differed (a 2-stage fp16 pipeline
    whose first 6 steps overflowed ended 0.0128 from the run without checkpoints). An optimizer without state has
    none again after (the state dict keeps the tensors); the script's step hooks are set aside for it."""
    empty = not any(optimizer.state.values())
    with quiet_step_hooks(optimizer):
        yield
    if empty:
        optimizer.state.clear()


def stage_state(module: torch.nn.Module, optimizer: Any) -> dict:
    """A pipeline stage's model and optimizer state under the whole model's parameter names, one key per
    tensor (flattened), so a checkpoint loads into any partition of the blocks (DCP reads the keys asked)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    # a stage of blocks without parameters or buffers (an activation) saves no model, one that trains none no optimizer
    state = {"model": get_model_state_dict(module) if module.state_dict() else {}}
    if optimizer is not None and any(group["params"] for group in optimizer.param_groups):
        with as_it_was(optimizer):
            state["optimizer"] = get_optimizer_state_dict(module, optimizer,
                                                          options=StateDictOptions(flatten_optimizer_state_dict=True))
    return state


def load_stage_state(module: torch.nn.Module, optimizer: Any, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    if state["model"]:
        set_model_state_dict(module, state["model"])
    if optimizer is not None and "optimizer" in state:
        with quiet_step_hooks(optimizer):
            set_optimizer_state_dict(module, optimizer, state["optimizer"],
                                     options=StateDictOptions(flatten_optimizer_state_dict=True))


def load_error_summary(e: BaseException) -> str:
    """torch's load_state_dict error in one line: its first difference (a key and both shapes), not its
    header alone, and how many more it lists."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    details = lines[1:] if lines[0].endswith(":") and len(lines) > 1 else lines
    more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
    first = details[0] if len(details[0]) <= 240 else details[0][:237] + "..."
    return first + more
