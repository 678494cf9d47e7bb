"""What a Session saves and restores, and when (DESIGN.md, invariant 5).

A checkpoint holds everything needed to continue exactly: model, optimizer, job-wide loss scale,
data position (epoch, step in epoch, seed), the balancer's split and measurements, the step, the
plan, and every rank's RNG states. Saves happen every `interval` steps, when any rank received
SIGTERM (agreed by all-reduce, so every rank saves the same step), and when the session closes.

On a different number of ranks (an elastic restart), the global batches continue in the same
order (they depend only on the seed and the global batch size), the split is recomputed for the
new ranks, and a new rank without an RNG state of its own keeps the one it started with.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hetrain.checkpoint.checkpointer import Checkpointer
from hetrain.checkpoint.rng import capture_rng, restore_rng
from hetrain.planning.plan import Plan

if TYPE_CHECKING:
    from hetrain.runtime.session import Session

log = logging.getLogger("hetrain.checkpoint")

CHECKPOINT_ENV = "HETRAIN_CHECKPOINT_DIR"
INTERVAL_ENV = "HETRAIN_CHECKPOINT_INTERVAL"


class SessionCheckpoints:
    """Saves a session every `interval` steps, on SIGTERM and at close; resumes it from the newest."""

    def __init__(self, session: "Session", directory: str | os.PathLike, *, interval: int = 100,
                 keep: int = 3, async_save: bool = True) -> None:
        self.session = session
        self.interval = interval
        self.checkpointer = Checkpointer(Path(directory), keep=keep, async_save=async_save)
        self.last_saved_step: int | None = None
        self.resumed_from: int | None = None
        self._sigterm = False
        self._previous_handler = None
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: the interval and close() still save
            pass

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True

    # -- what is saved -----------------------------------------------------------------------

    def _state(self) -> tuple[dict, dict]:
        s = self.session
        optimizer_state = s._optimizer_state_for_checkpoint()
        shared = {
            "step": s.step_count,
            "model": s._unwrapped_model().state_dict(),
            "optimizer": optimizer_state,
            "scaler": s.scaler.state_dict(),
            "balancer": s.balancer.state_dict(),
            "loader": s._loader.state_dict(),
            "world_size": s.world_size,
            "plan": s.plan.to_json() if s.plan is not None else "",
        }
        return shared, {"rng": capture_rng()}

    def save(self, *, blocking: bool | None = None) -> None:
        shared, per_rank = self._state()
        self.checkpointer.save(self.session.step_count, shared, per_rank, blocking=blocking)
        self.last_saved_step = self.session.step_count

    # -- when -----------------------------------------------------------------------------------

    def after_step(self) -> None:
        """Called at the end of every step: save on the interval or when any rank got SIGTERM."""
        s = self.session
        flag = torch.tensor([1.0 if self._sigterm else 0.0], device=s.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            log.warning("SIGTERM: saving step %d and stopping", s.step_count)
            self.save(blocking=True)
            self.checkpointer.close()
            raise SystemExit(143)
        if s.step_count % self.interval == 0:
            self.save()

    def close(self) -> None:
        if self.last_saved_step != self.session.step_count and self.session.step_count > 0:
            self.save(blocking=True)
        self.checkpointer.close()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)

    # -- resume -----------------------------------------------------------------------------------

    def resume(self) -> bool:
        """Restore the newest good checkpoint, if there is one; True when the session resumed."""
        info = self.checkpointer.latest()
        if info is None:
            return False
        shared, per_rank, _ = self.checkpointer.load(info)
        s = self.session
        s._unwrapped_model().load_state_dict(shared["model"])
        if shared["optimizer"] is not None and s.optimizer is not None:
            s._load_optimizer_state_from_checkpoint(shared["optimizer"])
        s.scaler.load_state_dict(shared["scaler"])
        s._loader.load_state_dict(shared["loader"])
        s.step_count = int(shared["step"])
        if int(shared["world_size"]) == s.world_size:
            s.balancer.load_state_dict(shared["balancer"])
        else:
            log.warning("resuming a %d-rank checkpoint on %d ranks: the global batches continue in order, "
                        "the split is recomputed (%s)", shared["world_size"], s.world_size, s.balancer.shares)
        if per_rank is not None:
            restore_rng(per_rank["rng"])
        self.resumed_from = s.step_count
        self.last_saved_step = s.step_count
        log.info("resumed from %s (step %d, epoch %d, step in epoch %d)", info.path, s.step_count,
                 s._loader.epoch, s._loader.step_in_epoch)
        return True


def saved_plan(shared: dict) -> Plan | None:
    """The plan stored with a checkpoint, if any."""
    return Plan.from_json(shared["plan"]) if shared.get("plan") else None
