"""`Session`: one rank's view of a heterogeneous data-parallel job (the loop in docs/design.md).

    session = hetrain.Session()
    model, optimizer = session.prepare(model, optimizer)
    loader = session.loader(dataset, global_batch_size=512, shuffle=True, seed=0)
    for batch in loader:                                  # on this rank's device
        with session.autocast():
            loss = loss_fn(model(batch[0]), batch[1])     # mean over this rank's samples (or tokens)
        session.backward(loss)                            # num_items=tokens for a token mean
        session.clip_grad_norm_(1.0)                      # optional: the global-batch gradient's norm
        session.step()

Any plan, pipelines included, also takes a step as one call: `session.forward_backward(...)`.
The Session is a facade over small parts with one concern each (docs/design.md lists them).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, overload

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.planning.plan import Plan, RankPlan
from hetrain.runtime.balance_config import balance_overrides, balance_setup, piece_caps
from hetrain.runtime.balancer import Balancer
from hetrain.runtime.batch_sampler import check_global_batch
from hetrain.runtime.comm_hooks import forget_feedback
from hetrain.runtime.companions import closed, follow, leading_loader, opened, other_parameters, pieces_in_step
from hetrain.runtime.cross_rank import gather_rows
from hetrain.runtime.data import HeteroLoader, make_loader
from hetrain.runtime.evaluation import evaluate
from hetrain.runtime.export import full_model_state
from hetrain.runtime.environment import (RankEnv, collective_timeout, configure_logging, init_process_group,
                                         leave_group, pick_device, print_user_errors_as_one_line, progress_timeout,
                                         restore_logging)
from hetrain.runtime.gradients import (GradientStatus, SkipCounter, StepFigures, agree_items_per_sample, clip_gradients,
                                       finish_gradients, launch_step_figures, weighted_mean)
from hetrain.runtime.reporting import Reports, metrics_port_setting, run_directory, start_metrics, step_record
from hetrain.runtime.parallelize import (Prepared, equal_piece_counts, exact_zeros, gradient_sync, graph_zeros,
                                         reduce_late_trainable)
from hetrain.runtime.pipeline_schedule import call_model, item_counter
from hetrain.runtime.prepare_model import prepare_model
from hetrain.runtime.pipeline_stages import check_pipeline_plan
from hetrain.runtime.plan_entries import find_entries, pipeline_assignment
from hetrain.runtime.precision import (LossScale, autocast, check_not_prescaled, configure_tf32, job_loss_scaler,
                                      loss_scale_settings)
from hetrain.runtime.resume import SessionCheckpoints, checkpoint_settings, start_checkpoints
from hetrain.runtime.schedulers import Schedulers
from hetrain.runtime.step_state import GLOBAL_MEAN_FIX, ONE_DATASET, ONE_MODEL, StepState, check_has_graph, items_as_number
from hetrain.runtime.step_clock import StepClock
from hetrain.runtime.step_guard import (BACKWARD_TWICE, KeptGradients, OptimizerStepGuard, SteadyLearningRate,
                                        check_reduced, gradients_pending, warn_if_evaluating)
from hetrain.runtime.timing import StepTimer, emulated_speed, figures_carrier, idle_fraction
from hetrain.runtime.train_state import TrainState
from hetrain.runtime.user_state import UserStates
from hetrain.runtime.meeting import after_step, meet, watch_loader
from hetrain.runtime.parent_death import die_with_parent
from hetrain.runtime.watchdog import ProgressWatch, collective_call
from hetrain.vocabulary import LOSSY_COMPRESSIONS, Env

log = logging.getLogger("hetrain")

TIMING_HISTORY = 4096   # steps of wall and compute time kept per rank


class Session:
    """Reads rank, world size and plan from the launcher, and runs one rank's part of each step."""

    def __init__(self, plan: Plan | str | os.PathLike | None = None, *, backend: str | None = None,
                 balance: bool | None = None, balance_interval: int | None = None,
                 device: str | torch.device | None = None, log_level: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_interval: int | None = None,
                 keep_checkpoints: int | None = 3, async_checkpoints: bool = True, metrics_port: int | None = None,
                 max_skipped_steps: int = 25, loss_scale: dict | LossScale | None = None) -> None:
        print_user_errors_as_one_line()
        if "TORCHELASTIC_RUN_ID" in os.environ:
            die_with_parent()   # a worker ends (saving on SIGTERM) when its launcher dies
        env = RankEnv.from_environ()
        self._log_level_token = configure_logging(log_level)
        # Every setting is read and checked before the process group exists: a bad value stops here.
        self._checkpoint_args = checkpoint_settings(checkpoint_dir, checkpoint_interval, keep_checkpoints,
                                                    async_checkpoints)
        self.metrics_port, self.metrics_port_given = metrics_port_setting(metrics_port), metrics_port is not None
        loss_scale, self._balance_overrides = loss_scale_settings(loss_scale), balance_overrides(balance, balance_interval)
        collective_timeout()
        if plan is None and os.environ.get(Env.PLAN):
            plan = os.environ[Env.PLAN]
        if plan is not None and not isinstance(plan, Plan):
            plan = Plan.load(plan)
        if plan is not None:
            check_pipeline_plan(plan)
        self.plan: Plan | None = plan
        self.device = pick_device(env.local_rank, device)
        self.owns_group, store = init_process_group(env, self.device, backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.watch = None
        if store is not None and self.world_size > 1:
            self.watch = ProgressWatch(store, self.rank, self.world_size, progress_timeout())
            self.watch.start()
        self.local_rank, self.restart_count = env.local_rank, env.restart_count
        self.assignment = find_entries(plan, self.device, env.local_rank, self.world_size)
        self.layout, self.pipeline = None, None   # PipelineLayout, PipelineRunner under a pipeline plan
        if plan is not None and plan.pipeline is not None:
            self.assignment, self.layout = pipeline_assignment(self.assignment, plan, self.rank)
        self.entry: RankPlan = self.assignment.entries[self.rank]
        self.precision = self.entry.precision
        self.sharding: str = plan.sharding if plan is not None else "none"
        configure_tf32(self.precision, self.device)
        self.scaler = job_loss_scaler(any(e.precision == "fp16" for e in self.assignment.entries), loss_scale,
                                      warn=self.is_main)
        self.emulated_speed = emulated_speed(self.rank, self.world_size)
        self.emulated = self.emulated_speed is not None or self.assignment.stand_in
        self.timer = StepTimer(speed=self.emulated_speed, on_grads_ready=self._waiting)
        self.state = StepState(self.world_size)
        self.prepared: Prepared | None = None
        self.balancer: Balancer | None = None
        self.train: TrainState | None = None
        self.schedulers, self.user_states = Schedulers(), UserStates()
        self.checkpoints: SessionCheckpoints | None = None
        self.run_dir = run_directory(self._checkpoint_args[0])   # the run's own files: run log, rates
        self.reports = Reports(self.run_dir, is_main=self.is_main)
        self.clock = StepClock(TIMING_HISTORY)
        self.step_seconds, self.compute_seconds = self.clock.step_seconds, self.clock.compute_seconds
        self._status: GradientStatus | None = None
        self._launched: StepFigures | None = None   # the step's figures, on their way to every rank
        self._grad_norm = None   # the last clip's norm
        self.skips = SkipCounter(max_skipped_steps, plan is not None and plan.comm.compression in LOSSY_COMPRESSIONS)
        self._kept, self._steady_lr = KeptGradients(), SteadyLearningRate()
        opened(self)
        if self.is_main:
            for note in self.assignment.notes:
                log.info("%s", note)
            if self.emulated_speed is not None:
                log.info("speeds are emulated on CPU ranks (%s): figures from this run are emulated",
                         os.environ.get(Env.EMULATE_SPEEDS))

    # -- set-up -------------------------------------------------------------------------------------

    _stopping = property(lambda self: bool(self.checkpoints and self.checkpoints.stop_requested))  # SIGTERM here

    def _waiting(self) -> None:
        if self.watch is not None:
            self.watch.waiting(self.step_count + 1)

    is_main = property(lambda self: self.rank == 0)
    optimizer = property(lambda self: self.prepared.optimizer if self.prepared is not None else None)
    blocks = property(lambda self: self.prepared.blocks if self.prepared is not None else [])
    micro_batch = property(lambda self: self.entry.micro_batch)
    model = property(lambda self: self.prepared.model if self.prepared is not None else None)   # prepared, wrapped

    @property
    def step_count(self) -> int:
        """Steps finished (resumed steps included)."""
        return self.train.step if self.train is not None else 0

    # -- the user's calls ---------------------------------------------------------------------------

    @overload
    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, blocks: list[torch.nn.Module]
                | None = None, find_unused_parameters: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        ...

    @overload
    def prepare(self, model: torch.nn.Module, optimizer: None = None, *, blocks: list[torch.nn.Module] | None = None,
                find_unused_parameters: bool = False) -> tuple[torch.nn.Module, None]: ...

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                blocks: list[torch.nn.Module] | None = None, find_unused_parameters: bool = False
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """The model on this rank's device with its plan entry applied (activation checkpointing of
        `blocks`, found when not given; FSDP2 or DDP with the plan's comm hook; ZeRO-1). Under DDP,
        `find_unused_parameters=True` is DDP's: for forwards that leave some parameters without a gradient."""
        if self.prepared is not None:
            raise HetrainError(ONE_MODEL)
        with collective_call(self.watch, "prepare"):   # a rank that stalls in its collectives names the call
            self.prepared, self.pipeline = prepare_model(self, model, optimizer, blocks, find_unused_parameters)
        self._step_guard = OptimizerStepGuard.of(self.optimizer, given=optimizer, model=model)
        return self.prepared.model, self.prepared.optimizer

    def add_scheduler(self, scheduler: Any) -> Any:
        """An LR scheduler on the optimizer `prepare()` returned: stepped after each applied update (not by the
        loop), checkpointed and resumed (hetrain.runtime.schedulers). Returns it."""
        self.schedulers.add(scheduler, self.optimizer)
        return scheduler

    def add_state(self, name: str, obj: Any) -> Any:
        """The script's own state (an EMA model, a metric, a dict of values), saved in every checkpoint and
        restored on resume, as rank 0 holds it (hetrain.runtime.user_state, docs/checkpoints.md). Returns it."""
        self.user_states.add(name, obj)
        return obj

    def loader(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
               drop_last: bool = True, **options: Any) -> HeteroLoader:
        """This rank's slices of one sequence of global batches (the same for any world size or split),
        on this rank's device. `dataset` is map-style or a stream (IterableDataset); `options` are
        torch DataLoader's (num_workers, pin_memory, prefetch_factor, persistent_workers, collate_fn,
        worker_init_fn, ...; see `hetrain.runtime.data.make_loader` and docs/data.md)."""
        global_batch_size = check_global_batch(global_batch_size, self.world_size)
        if self.train is not None:
            raise HetrainError(ONE_DATASET)
        if self.prepared is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.loader()")
        leader = leading_loader(self, global_batch_size, self._checkpoint_args[0])   # a companion session's
        setup = balance_setup(self.plan, self.assignment.shares, self.world_size, global_batch_size,
                              *self._balance_overrides, pipeline=self.layout is not None or leader is not None)
        pieces = self.assignment.pieces if equal_piece_counts(self.prepared.model, self.sharding, self.layout) \
            or pieces_in_step(self) else None   # the job's count
        self.state.equal_pieces = pieces is not None
        balancer = self.balancer = Balancer(config=setup.config, shares=setup.shares, devices=self.assignment.devices,
                                            rank=self.rank, share_caps=piece_caps(setup.shares, pieces))
        loader = make_loader(dataset, global_batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                             rank=self.rank, split=balancer, step=self.state, device=self.device,
                             micro_batch=self.entry.micro_batch, grad_accum=self.entry.grad_accum,
                             gradient_sync=lambda sync: gradient_sync(self.prepared, self.sharding, sync),
                             same_piece_count=pieces, **options)
        follow(loader, leader)   # None: its own split
        balancer.lag = loader.lag   # a new split reaches the loop this many steps after it is decided
        loader.gradients_pending = lambda: gradients_pending(self.prepared.model)
        watch_loader(loader, self.watch, lambda: self.train.step + 1)   # reading, computing, a stream's end
        train = TrainState(self.prepared, self.sharding, self.scaler, self.balancer, loader, self.plan, self.world_size,
                           self.rank, schedulers=self.schedulers, step_state=self.state, user_states=self.user_states,
                           device=self.device)
        # resumes the newest checkpoint; a failed resume leaves the session without a loader (and the directory free)
        self.checkpoints = start_checkpoints(train, self._checkpoint_args, lambda: list(self.step_seconds)[-20:],
                                             self.reports.checkpoint)
        self.train = train
        self.skips.total = self.train.skipped_steps   # a resumed run keeps counting its skipped steps
        start_metrics(self)   # Prometheus and the run log (a GAN's second session leaves them to its first)
        return loader

    @property
    def shares(self) -> list[int]:
        """Samples of each full global batch that each rank takes, by rank, in the step last handed out
        (a re-split the balancer decides reaches the loader a few steps later: `balancer.shares`)."""
        if self.train is None:
            raise HetrainError("no split yet: call session.loader(dataset, global_batch_size) first")
        return self.train.loader.current_shares

    local_batch_size = property(lambda self: self.state.local_samples)   # this rank's samples in the current step

    def autocast(self) -> AbstractContextManager[Any]:
        """This rank's precision for the forward pass (bf16/fp16 autocast, or none)."""
        return autocast(self.precision, self.device, self.sharding)

    def forward_backward(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                         num_items: Any = None) -> torch.Tensor:
        """Forward and backward of this rank's batch under any plan: `loss_fn(model(*inputs), target)` (a dict:
        `model(**inputs)`, data parallel) is a (micro-)batch's mean; `num_items(target)` counts its items.

        Data parallel: one forward under `autocast()` and `backward(loss, num_items)`. Pipeline: the
        replica's batch runs through every stage on the plan's schedule and micro-batches. Returns the
        local mean loss (NaN on pipeline stages that hold no loss); `session.loss` after `step()` is the
        global-batch mean."""
        if self.prepared is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.forward_backward()")
        self.state.require_batch("forward_backward")
        if self.pipeline is None:
            with self.autocast():
                output = call_model(self.prepared.model, inputs)
                loss = loss_fn(output, target)
            items = num_items(target) if callable(num_items) else num_items
            self.backward(loss, items)
            return loss.detach()
        self.timer.step_begins()   # the script's own time ends (no module hook sees a pipeline's step begin)
        inputs, target = self.pipeline.gather_batch((inputs, target))
        loss = self.pipeline.run(inputs, target, loss_fn, item_counter(num_items), state=self.state, scaler=self.scaler)
        self._status = None
        self.timer.backward_returned(True)   # until step(), the loop body's own time
        return loss if loss is not None else torch.tensor(float("nan"), device=self.device)

    def evaluate(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                 num_items: Any = None) -> float:
        """The item-weighted mean of `loss_fn(model(*inputs), target)` over every rank's batch, forward only,
        under any plan, pipelines included (collective: each rank passes its part of the evaluation set)."""
        return evaluate(self, inputs, target, loss_fn, num_items)

    def backward(self, loss: torch.Tensor, num_items: Any = None) -> None:
        """Backward of this rank's mean loss over `num_items` items (default: its samples), weighted so
        that the update is the gradient of the mean over every item of the global batch."""
        if self.prepared is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.backward()")
        if self.pipeline is not None:
            raise HetrainError("under a pipeline plan no rank holds the whole model: run each step with "
                               "session.forward_backward(inputs, target, loss_fn) instead of model(...) and backward()")
        self.state.require_batch("backward")
        if self.state.backwards >= max(self.state.micros, 1):   # the batch's gradients are weighted (or finished)
            raise HetrainError(BACKWARD_TWICE)
        check_not_prescaled(loss)
        warn_if_evaluating(self.prepared.module)
        items = self.state.current_samples() if num_items is None else items_as_number(num_items)
        items = 0 if self.state.micro_samples == 0 else items   # a piece without samples of its own counts nothing
        check_has_graph(loss, items)   # before anything is counted or checked: the retry finds all as it was
        with self.timer.collective():   # under FSDP2 the ranks agree in it: a wait on a slower forward is not compute
            self._kept.check(self.prepared.parameters, self.state, self.device if self.sharding == "fsdp" else None,
                             self.optimizer)
        self.prepared.check_pieces()   # nothing wrote to the model between this step's micro-batches
        if self.state.items_per_sample is None:   # the run's first backward: the ranks agree on an estimate
            self.state.items_per_sample = agree_items_per_sample(items, self.state.current_samples(), self.device)
        self.state.record_backward(loss, items)
        self._launch_figures()
        if items == 0 and (self.sharding == "fsdp" or self.prepared.sync_batchnorm):
            # No items: zeros through the forward's graph (FSDP2's reduce-scatter, SyncBatchNorm's backward).
            weighted = graph_zeros(self.prepared, loss, other_parameters(self), self.state.local_samples == 0)
        elif items == 0:   # no items: exact zeros, still joining every collective
            weighted = exact_zeros(self.prepared, loss, other_parameters(self), self.state.local_samples == 0)
        else:
            weighted = loss * self.state.weight(items)
        self.prepared.backward(self.scaler.scale_loss(weighted), self.state.backwards == 1, self.state.last_micro)
        self._kept.after_backward(self.prepared.parameters, self.state.last_micro)
        self._status = None
        if self.state.last_micro:   # finished now: what the script does before step() (torch's clipping,
            self._finish_gradients()   # logging a norm) sees the global batch's final, unscaled gradients
        self.timer.backward_returned(self.state.last_micro)   # until the next forward (or step()): the script's time

    def _launch_figures(self) -> None:
        """Before the step's last backward, start the all-reduce of its items and loss (replicated gradients)."""
        if not self.state.last_micro or self.sharding == "fsdp" or self.pipeline is not None:
            return
        if self._launched is not None and self._launched.work is not None:   # a step left without step()
            self._launched.work.wait()
        # plain DDP: the figures ride in a small gradient bucket's all-reduce, no collective of their own
        carrier = figures_carrier(self.prepared.comm_state)
        self._launched = launch_step_figures(self.state, self.device, with_gradients=carrier, stop=self._stopping)

    def _finish_gradients(self) -> GradientStatus:
        """Unscale and normalise the step's gradients once, agreeing with every rank (collective)."""
        if self._status is None:
            if self.pipeline is None and self.state.backwards == 0:
                raise HetrainError("this step's batch had no session.backward(loss): call it in place of "
                                   "loss.backward(), which leaves each rank's gradient unweighted by its share "
                                   "of the global batch (a rank with no items calls it too)")
            if self.pipeline is None and self.sharding != "fsdp":
                check_reduced(self.prepared.comm_state, self.prepared.find_unused)
                reduce_late_trainable(self.prepared)
            if self.sharding == "fsdp":
                self.timer.grads_ready()  # FSDP2 has no comm hook: backward (and its reduce-scatter) ended here
            if self.pipeline is not None:
                self.timer.compute_s = self.pipeline.take_busy_seconds()   # the stage's own compute this step
                self.pipeline.sync_gradients()
            self._status = finish_gradients(self.prepared.parameters, self.state, self.scaler.scale,
                                            self.device, launched=self._launched, stop=self._stopping)
            self._launched = None
            if self.pipeline is None:   # every rank holds rank 0's buffers between steps (hetrain.runtime.buffers)
                self.prepared.sync_buffers(self.state.buffer_source)
            if self.pipeline is None and self.sharding != "fsdp":   # replicated: step() tells a later change
                self._kept.note_finished(self.prepared.parameters, self._status.global_items > 0)
        return self._status

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the global-batch gradient to `max_norm` and return its total norm (the same on every rank).

        Call it between the step's last `backward` and `step`; it unscales fp16 gradients first. A
        non-finite norm makes every rank skip the step. On a micro-batch that is not the step's last
        it does nothing and returns None (gradients are still accumulating)."""
        if self.prepared is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.clip_grad_norm_()")
        self.state.require_batch("clip_grad_norm_")
        if not self.state.last_micro:
            return None
        with self.timer.collective():   # the ranks' wait in it is not the script's time
            status = self._finish_gradients()
            params = [p for p in self.prepared.parameters if p.grad is not None]
            if self.pipeline is not None:
                norm = self.pipeline.total_norm(norm_type)
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            else:   # a step skipped for non-finite gradients tells their norm (inf or NaN), as torch's clipping does
                norm = clip_gradients(params, max_norm, norm_type)
        self._grad_norm = float(norm)
        if not math.isfinite(self._grad_norm):
            self._status = dataclasses.replace(status, found_inf=True)
        return norm

    def step(self) -> bool:
        """The optimizer step (skipped on every rank when any gradient is non-finite), then zero the
        gradients, re-split, checkpoint and report. True when the update was applied. On a micro-batch
        that is not the step's last, it returns False and gradients keep accumulating."""
        if self.optimizer is None:
            raise HetrainError("session.step() needs an optimizer: pass it to session.prepare(model, optimizer)")
        self.state.require_batch("step")
        self._steady_lr.check(self.optimizer, self.state.last_micro)
        if not self.state.last_micro:
            return False
        self.timer.step_called()   # the script's own time since the last backward ends here
        status = self._finish_gradients()
        self.prepared.before_step()   # no backward of the script's own joined the step's gradients
        self.schedulers.check_not_stepped_elsewhere(abandon=lambda: self.optimizer.zero_grad(set_to_none=True))
        if self._kept.broke_since_finish(self.prepared.parameters, self.device,
                                         None if self.pipeline else self.sharding, status.found_inf):
            status = dataclasses.replace(status, found_inf=True)   # skipped too
        applied = not status.found_inf and not self.skips.without_items(status, self.train.step + 1, self.is_main)
        self.state.skipped_last = status.found_inf
        if status.found_inf:   # what compression carries holds part of the skipped gradients (or their inf)
            forget_feedback(self.prepared.comm_state)
        with self._step_guard.allowed():
            self.timer.time_optimizer(self.optimizer.step if applied else (lambda: None))
            self.optimizer.zero_grad(set_to_none=True)
        self.schedulers.step(applied)
        self.train.skipped_steps += self.skips.count(applied, self.train.step + 1, self.scaler.scale, self.is_main,
                                                     status.where())
        if applied or status.found_inf:   # a step without items leaves the loss scale as it is
            self.scaler.update(applied)
        first_forward = self.timer.started_at
        compute = self.timer.end_step()
        data_wait = self.train.loader.data_wait_seconds
        times = self.clock.step_ended(first_forward, compute, data_wait, self.timer.last_between_s)
        totals = self.state.finish(status.global_items, status.loss)
        self.balancer.record(totals.local_samples, compute + data_wait, self.timer.last_optimizer_s)
        self.train.step += 1
        changed = self.balancer.settle(self.train.step)   # on the figures exchanged one step ago, if any
        if changed is not None:
            self.reports.save_rates(self.assignment.entries, self.balancer, step=self.train.step, emulated=self.emulated)
        self.balancer.begin_exchange(self.device, step=self.train.step)   # when an interval ends here
        if self.reports.observers:
            self.reports.step(self.balancer.with_reason(step_record(self, totals, times, compute, data_wait,
                                                                    not status.found_inf, bool(changed), self._grad_norm)))
        self._status, self._grad_norm = None, None
        if self.checkpoints is not None:
            with self.clock.checkpoint():
                self.checkpoints.after_step(stop=status.stop)
        after_step(self.watch, self.train.step + 1)   # the script's own code until the next batch is read
        self.clock.returned()
        return applied

    # -- figures for users and tools ----------------------------------------------------------------

    @property
    def loss(self) -> float | None:
        """The global-batch mean loss of the last finished step (item-weighted over every rank; a resumed checkpoint's
        until this process's first step)."""
        return self.state.last_loss

    def global_mean(self, value: torch.Tensor | float, weight: float | None = None) -> float:
        """The mean over ranks of per-rank means, weighted by their items (this step's, or the last's) (collective)."""
        self.state.refuse_between_micro_batches("session.global_mean()", GLOBAL_MEAN_FIX, forward=False)
        with self.timer.collective():
            return weighted_mean(value, self.state.mean_weight() if weight is None else weight, self.device)

    def idle_fraction(self, last: int | None = None) -> float:
        """Fraction of this rank's wall time per step spent not computing (waiting on others, for data
        or a checkpoint, and the script's own time): the dashboard's idle fraction."""
        return idle_fraction(self.step_seconds, self.compute_seconds, last)

    def add_observer(self, observer: Any) -> None:
        """Something with `on_step(StepRecord)` (and optionally `on_checkpoint`, `close`), called each step."""
        self.reports.add(observer)

    observers = property(lambda self: self.reports.observers)
    def gather_rows(self, tensor: torch.Tensor, *, offset: bool = False) -> Any:   # hetrain.runtime.cross_rank
        """Every rank's rows of `tensor`, in rank order; the gradient reaches each rank's own (collective)."""
        return gather_rows(tensor, offset=offset, cut=self.state.cut, waiting=self.timer.collective)

    def barrier(self) -> None:
        """Every rank waits until each has reached it, however long one rank's work before it takes (collective)."""
        self.state.check_open()
        with self.timer.collective():
            meet(self.watch)

    def model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict, on rank 0 (None elsewhere), under any plan: CPU tensors under the
        names of the model given to prepare(), pipeline stages and FSDP2 shards gathered (collective)."""
        return full_model_state(self)

    def close(self) -> None:
        """Save a final checkpoint (when checkpointing), leave the process group if this session started it."""
        # leaving alone on an error (not the agreed SIGTERM stop): the others may be inside a step
        failing = self.world_size > 1 and sys.exc_info()[0] not in (None, SystemExit)
        self.state.closed = True
        closed(self)
        OptimizerStepGuard.remove(getattr(self, "_step_guard", None))   # the optimizer steps freely again
        if getattr(self, "prepared", None) is not None:
            self.prepared.release()
        if self.watch is not None:
            self.watch.stop(sys.exc_info()[1] if failing else None)   # the others are told why
            self.watch = None
        checkpoints, self.checkpoints = self.checkpoints, None
        try:   # a final save or an observer's close() that raises (raised here) leaves nothing else open
            if checkpoints is not None:   # no final checkpoint the others, in a step, could not join
                checkpoints.close(save=not failing)
        finally:
            try:
                self.reports.close()
            finally:
                restore_logging(self._log_level_token)
                if self.owns_group and dist.is_initialized():
                    leave_group(failing, self.balancer.arrived if self.balancer is not None else None)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
