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

The Session is a facade: the work is done by small parts with one concern each (environment,
plan_entries, parallelize, precision, step_state, gradients, data, balancer, train_state, resume).
"""

from __future__ import annotations

import collections
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.balancer import Balancer
from hetrain.runtime.data import HeteroLoader, make_loader
from hetrain.runtime.environment import (RankEnv, configure_logging, env_int, init_process_group, pick_device,
                                         print_user_errors_as_one_line)
from hetrain.runtime.events import CheckpointRecord, StepRecord
from hetrain.runtime.gradients import GradientStatus, clip_gradients, finish_gradients
from hetrain.runtime.measured import FlopMeter, rates_by_kind
from hetrain.runtime.parallelize import Prepared, gradient_sync, parallelize
from hetrain.runtime.plan_entries import Assignment, assign_entries, local_device_kind
from hetrain.runtime.precision import JobLossScaler, autocast, configure_tf32
from hetrain.runtime.resume import SessionCheckpoints
from hetrain.runtime.step_state import StepState, items_as_number
from hetrain.runtime.timing import StepTimer, emulated_speed
from hetrain.runtime.train_state import TrainState
from hetrain.vocabulary import PIPELINE_STRATEGIES, Env

log = logging.getLogger("hetrain")

TIMING_HISTORY = 4096   # steps of wall and compute time kept per rank


class Session:
    """Reads rank, world size and plan from the launcher, and runs one rank's part of each step."""

    def __init__(self, plan: Plan | str | os.PathLike | None = None, *, backend: str | None = None,
                 balance: bool | None = None, balance_interval: int | None = None,
                 device: str | torch.device | None = None, log_level: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_interval: int | None = None,
                 keep_checkpoints: int = 3, async_checkpoints: bool = True, metrics_port: int | None = None,
                 max_skipped_steps: int = 25) -> None:
        print_user_errors_as_one_line()
        env = RankEnv.from_environ()
        configure_logging(log_level)
        if plan is None and os.environ.get(Env.PLAN):
            plan = os.environ[Env.PLAN]
        if plan is not None and not isinstance(plan, Plan):
            plan = Plan.load(plan)
        if plan is not None:
            _refuse_pipeline(plan)
        self.plan: Plan | None = plan
        self.device = pick_device(env.local_rank, device)
        self._owns_group = init_process_group(env, self.device, backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank, self.restart_count = env.local_rank, env.restart_count
        self.assignment = self._find_entries(plan)
        self.entry: RankPlan = self.assignment.entries[self.rank]
        self.precision = self.entry.precision
        self.sharding: str = plan.sharding if plan is not None else "none"
        configure_tf32(self.precision, self.device)
        self.scaler = JobLossScaler(enabled=any(e.precision == "fp16" for e in self.assignment.entries))
        self.emulated_speed = emulated_speed(self.rank, self.world_size)
        self.emulated = self.emulated_speed is not None or self.assignment.stand_in
        self.timer = StepTimer(speed=self.emulated_speed)
        self.state = StepState(self.world_size)
        self.max_skipped_steps = max_skipped_steps
        self._balance_overrides = (balance, balance_interval)
        self._checkpoint_args = (checkpoint_dir or os.environ.get(Env.CHECKPOINT_DIR) or None,
                                 checkpoint_interval or env_int(Env.CHECKPOINT_INTERVAL, 100), keep_checkpoints,
                                 async_checkpoints)
        self._metrics_port = metrics_port if metrics_port is not None else env_int(Env.METRICS_PORT, 0) or None
        self.prepared: Prepared | None = None
        self.balancer: Balancer | None = None
        self.train: TrainState | None = None
        self.checkpoints: SessionCheckpoints | None = None
        self.observers: list[Any] = []
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=TIMING_HISTORY)
        self.compute_seconds: collections.deque[float] = collections.deque(maxlen=TIMING_HISTORY)
        self._status: GradientStatus | None = None
        self._grad_norm: float | None = None
        self._consecutive_skips = 0
        self._skipped_total = 0
        self._last_step_end: float | None = None
        self._flop_meter: FlopMeter | None = None
        self._first_items: float | None = None
        if self.is_main:
            for note in self.assignment.notes:
                log.info("%s", note)
            if self.emulated_speed is not None:
                log.info("speeds are emulated on CPU ranks (%s): figures from this run are emulated",
                         os.environ.get(Env.EMULATE_SPEEDS))

    # -- set-up -------------------------------------------------------------------------------------

    def _find_entries(self, plan: Plan | None) -> Assignment:
        """Every rank's plan entry, looked up by the device kind each rank has (all-gathered)."""
        kind, stand_in = local_device_kind(self.device, self.local_rank)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (kind, stand_in))
        kinds, emulated = [k for k, _ in gathered], [s for _, s in gathered]
        if plan is None:
            return Assignment([RankPlan(rank=r, device=k, share=0) for r, k in enumerate(kinds)],
                              stand_in=any(emulated))
        return assign_entries(plan, kinds, emulated)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def model(self) -> torch.nn.Module | None:
        """The prepared (wrapped) model."""
        return self.prepared.model if self.prepared is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.prepared.optimizer if self.prepared is not None else None

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return self.prepared.blocks if self.prepared is not None else []

    @property
    def step_count(self) -> int:
        """Steps finished (resumed steps included)."""
        return self.train.step if self.train is not None else 0

    @property
    def micro_batch(self) -> int | None:
        return self.entry.micro_batch

    # -- the user's calls ---------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                blocks: list[torch.nn.Module] | None = None
                ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """The model on this rank's device with its plan entry applied (activation checkpointing of
        `blocks`, found when not given; FSDP2 or DDP with the plan's comm hook; ZeRO-1)."""
        if self.prepared is not None:
            raise HetrainError("session.prepare() was already called; a session trains one model")
        self.prepared = parallelize(model, optimizer, sharding_name=self.sharding, entries=self.assignment.entries,
                                    rank=self.rank, comm=self.plan.comm if self.plan is not None else None,
                                    device=self.device, timer=self.timer, blocks=blocks)
        return self.prepared.model, self.prepared.optimizer

    def loader(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
               drop_last: bool = True, **options: Any) -> HeteroLoader:
        """This rank's slices of one sequence of global batches (the same for any world size or split),
        on this rank's device. `dataset` is map-style or a stream (IterableDataset); `options` are
        torch DataLoader's (num_workers, pin_memory, prefetch_factor, persistent_workers, collate_fn,
        worker_init_fn, ...; see `hetrain.runtime.data.make_loader` and docs/data.md)."""
        if global_batch_size < self.world_size:
            raise HetrainError(
                f"global batch size {global_batch_size} is smaller than the number of ranks "
                f"({self.world_size}); use a global batch of at least {self.world_size}"
            )
        if self.balancer is not None:
            raise HetrainError("session.loader() was already called; a session reads one dataset")
        if self.prepared is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.loader()")
        balancer = self._make_balancer(global_batch_size)
        loader = make_loader(dataset, global_batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                             rank=self.rank, split=balancer, step=self.state, device=self.device,
                             micro_batch=self.entry.micro_batch, grad_accum=self.entry.grad_accum,
                             gradient_sync=lambda sync: gradient_sync(self.prepared, self.sharding, sync), **options)
        balancer.lag = loader.lag   # a new split reaches the loop this many steps after it is decided
        self.balancer = balancer
        self.train = TrainState(self.prepared, self.sharding, self.scaler, self.balancer, loader, self.plan,
                                self.world_size, self.rank)
        self._start_checkpoints()
        self._start_metrics()
        return loader

    def _make_balancer(self, global_batch_size: int) -> Balancer:
        plan = self.plan
        if plan is not None and plan.global_batch_size != global_batch_size:
            raise HetrainError(
                f"the plan is for a global batch of {plan.global_batch_size}, the loader asks for "
                f"{global_batch_size}; use the same global_batch_size or re-plan"
            )
        shares = self.assignment.shares if plan is not None else Plan.even(self.world_size, global_batch_size).shares
        config = (plan.balance if plan is not None else BalancePlan()).model_copy()
        balance, interval = self._balance_overrides
        if balance is not None:
            config.enabled = balance
        if interval is not None:
            config.interval = interval
        if config.min_share * self.world_size > global_batch_size:
            raise HetrainError(
                f"balance.min_share {config.min_share} on {self.world_size} ranks needs a global batch of at least "
                f"{config.min_share * self.world_size}, not {global_batch_size}; lower min_share or raise the global batch"
            )
        return Balancer(config=config, shares=list(shares), rank=self.rank)

    @property
    def shares(self) -> list[int]:
        """Samples of each full global batch that each rank takes, by rank."""
        if self.balancer is None:
            raise HetrainError("no split yet: call session.loader(dataset, global_batch_size) first")
        return self.balancer.shares

    @property
    def local_batch_size(self) -> int | None:
        """Samples this rank computes in the current step."""
        return self.state.local_samples

    def autocast(self):
        """This rank's precision for the forward pass (bf16/fp16 autocast, or none)."""
        return autocast(self.precision, self.device)

    def backward(self, loss: torch.Tensor, num_items: Any = None) -> None:
        """Backward of this rank's mean loss over `num_items` items (default: its samples), weighted so
        that the update is the gradient of the mean over every item of the global batch."""
        if self.prepared is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.backward()")
        self.state.require_batch("backward")
        items = self.state.current_samples() if num_items is None else items_as_number(num_items)
        if self._first_items is None:
            self._first_items = items   # the items of the forward the FLOP meter counted
        self.state.record_backward(loss, items)
        if items == 0 and self.sharding == "fsdp":
            # No items: exact zeros through the forward's graph, which FSDP2's reduce-scatter needs.
            weighted = torch.nan_to_num(loss) * 0.0
        elif items == 0:
            # No items: contribute exact zeros to every gradient, still joining every collective.
            weighted = sum((p.sum() * 0.0) for p in self.prepared.model.parameters() if p.requires_grad)
        else:
            weighted = loss * self.state.weight(items)
        self.scaler.scale_loss(weighted).backward()
        self._status = None

    def _finish_gradients(self) -> GradientStatus:
        """Unscale and normalise the step's gradients once, agreeing with every rank (collective)."""
        if self._status is None:
            if self.sharding == "fsdp":
                self.timer.grads_ready()  # FSDP2 has no comm hook: backward (and its reduce-scatter) ended here
            self._status = finish_gradients(self.prepared.model.parameters(), self.state, self.scaler.scale,
                                            self.device)
        return self._status

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the global-batch gradient to `max_norm` and return its total norm (the same on every rank).

        Call it between the step's last `backward` and `step`; it unscales fp16 gradients first. A
        non-finite norm makes every rank skip the step. On a micro-batch that is not the step's last
        it does nothing and returns None (gradients are still accumulating).
        """
        if self.prepared is None:
            raise HetrainError("call session.prepare(model, optimizer) before session.clip_grad_norm_()")
        self.state.require_batch("clip_grad_norm_")
        if not self.state.last_micro:
            return None
        status = self._finish_gradients()
        params = [p for p in self.prepared.model.parameters() if p.grad is not None]
        if status.found_inf:
            norm = torch.tensor(float("inf"), device=self.device)
        else:
            norm = clip_gradients(params, max_norm, norm_type)
        self._grad_norm = float(norm)
        if not math.isfinite(self._grad_norm):
            self._status = GradientStatus(True, status.global_items, status.loss)
        return norm

    def step(self) -> bool:
        """The optimizer step (skipped on every rank when any gradient is non-finite), then zero the
        gradients, re-split, checkpoint and report. True when the update was applied. On a micro-batch
        that is not the step's last, it returns False and gradients keep accumulating."""
        if self.optimizer is None:
            raise HetrainError("session.step() needs an optimizer: pass it to session.prepare(model, optimizer)")
        self.state.require_batch("step")
        if not self.state.last_micro:
            return False
        status = self._finish_gradients()
        applied = not status.found_inf
        self.timer.time_optimizer(self.optimizer.step if applied else (lambda: None))
        self.scaler.update(applied)
        self.optimizer.zero_grad(set_to_none=True)
        self._count_skips(applied)
        compute = self.timer.end_step()
        now = _now()
        wall = now - self._last_step_end if self._last_step_end is not None else None
        if wall is not None:
            self.step_seconds.append(wall)
            self.compute_seconds.append(compute)
        self._last_step_end = now
        totals = self.state.finish(status.global_items, status.loss)
        data_wait = self.train.loader.data_wait_seconds
        self.balancer.record(totals.local_samples, compute + data_wait)
        self.train.step += 1
        changed = False
        if self.balancer.due(self.train.step):
            changed = self.balancer.rebalance(self.train.step, self.balancer.exchange(self.device))
            self._save_rates()
        self._count_flops(totals)
        self._report(totals, wall, compute, data_wait, applied, changed)
        self._status, self._grad_norm = None, None
        if self.checkpoints is not None:
            self.checkpoints.after_step()
        return applied

    def _count_skips(self, applied: bool) -> None:
        if applied:
            self._consecutive_skips = 0
            return
        self._consecutive_skips += 1
        self._skipped_total += 1
        self.train.skipped_steps += 1
        step = self.train.step + 1
        if self.is_main:
            log.warning("step %d skipped: non-finite gradients on some rank (loss scale %g; %d skipped so far)",
                        step, self.scaler.scale, self._skipped_total)
        if self._consecutive_skips >= self.max_skipped_steps:
            raise HetrainError(
                f"{self._consecutive_skips} steps in a row had non-finite gradients (up to step {step}); the last "
                "checkpoint holds the last good weights: lower the learning rate, clip gradients, or check the data"
            )

    # -- figures for users and tools ----------------------------------------------------------------

    @property
    def loss(self) -> float | None:
        """The global-batch mean loss of the last finished step (item-weighted over every rank)."""
        return self.state.last.loss if self.state.last is not None else None

    def global_mean(self, value: torch.Tensor | float, weight: float | None = None) -> float:
        """The mean over all ranks of per-rank means, weighted by each rank's items: by default this
        step's items so far, or the last finished step's after `step()` (collective)."""
        if weight is None:
            if self.state.active:
                weight = self.state.items or self.state.current_samples()
            elif self.state.last is not None:
                weight = self.state.last.local_items
            else:
                weight = 0.0
        w = float(weight)
        v = float(value.detach().float().item() if isinstance(value, torch.Tensor) else value)
        t = torch.tensor([v * w if w else 0.0, w], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t[0] / t[1]) if t[1] > 0 else float("nan")

    def idle_fraction(self, last: int | None = None) -> float:
        """Fraction of this rank's wall time per step spent not computing (waiting on others or data)."""
        wall = list(self.step_seconds)[-last:] if last else list(self.step_seconds)
        comp = list(self.compute_seconds)[-last:] if last else list(self.compute_seconds)
        return max(0.0, 1.0 - sum(comp) / sum(wall)) if wall and sum(wall) > 0 else 0.0

    def add_observer(self, observer: Any) -> None:
        """Something with `on_step(StepRecord)` (and optionally `on_checkpoint`, `close`), called each step."""
        self.observers.append(observer)

    def _report(self, totals, wall: float | None, compute: float, data_wait: float, applied: bool,
                changed: bool) -> None:
        if not self.observers:
            return
        record = StepRecord(
            step=self.train.step, rank=self.rank, world_size=self.world_size, device=self.entry.device,
            precision=self.precision, share=self.balancer.shares[self.rank], samples=totals.local_samples,
            items=int(totals.local_items), global_samples=totals.global_samples, global_items=int(totals.global_items),
            step_seconds=wall, compute_seconds=compute, data_wait_seconds=data_wait,
            optimizer_seconds=self.timer.last_optimizer_s, loss=totals.loss, grad_norm=self._grad_norm,
            loss_scale=self.scaler.scale, skipped=not applied, skipped_total=self._skipped_total,
            shares=tuple(self.balancer.shares), split_changed=changed,
            comm_bytes=_comm_bytes(self.prepared.comm_state), emulated=self.emulated)
        for observer in self.observers:
            observer.on_step(record)

    def _save_rates(self) -> None:
        """Rank 0 writes the rates measured so far by device kind (for `hetrain plan --from-run`)."""
        directory = self.run_dir
        if not self.is_main or directory is None or self.balancer.costs is None:
            return
        rates = rates_by_kind(self.assignment.entries, self.balancer.costs, self.balancer.shares,
                              step=self.train.step, global_batch_size=sum(self.balancer.shares),
                              emulated=self.emulated)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            rates.save(directory)
        except OSError as e:
            log.warning("measured rates not written to %s (%s)", directory, e)

    def _count_flops(self, totals) -> None:
        """After the first measured forward: the model's FLOPs per item (forward and backward), for MFU."""
        meter = self._flop_meter
        if meter is None or meter.flops is None:
            return
        self._flop_meter = None
        items = self._first_items or totals.local_items
        if meter.flops and items:
            per_item = 3.0 * meter.flops / items
            for observer in self.observers:
                if hasattr(observer, "flops_per_item"):
                    observer.flops_per_item = per_item

    def _on_checkpoint(self, record: CheckpointRecord) -> None:
        for observer in self.observers:
            hook = getattr(observer, "on_checkpoint", None)
            if hook is not None:
                hook(record)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Save a final checkpoint (when checkpointing), then leave the process group if this session started it."""
        if self.checkpoints is not None:
            self.checkpoints.close()
            self.checkpoints = None
        for observer in self.observers:
            closer = getattr(observer, "close", None)
            if closer is not None:
                closer()
        self.observers = []
        if self._owns_group and dist.is_initialized():
            # Every rank reaches this point before the group is torn down: destroying gloo's
            # group while a peer is still in a collective can abort the process at exit.
            dist.barrier()
            dist.destroy_process_group()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- services: checkpoints and metrics ----------------------------------------------------------

    @property
    def run_dir(self) -> Path | None:
        """Where the run's own files go (measured rates, run log): HETRAIN_RUN_DIR, else the checkpoint directory."""
        chosen = os.environ.get(Env.RUN_DIR) or self._checkpoint_args[0]
        return Path(chosen) if chosen else None

    def _start_checkpoints(self) -> None:
        directory, interval, keep, async_save = self._checkpoint_args
        if directory is None:
            return
        self.checkpoints = SessionCheckpoints(self.train, directory, interval=interval, keep=keep,
                                              async_save=async_save, device=self.device,
                                              recent_step_seconds=lambda: list(self.step_seconds)[-20:],
                                              on_saved=self._on_checkpoint)
        self.checkpoints.resume()

    def _start_metrics(self) -> None:
        if self._metrics_port is None:
            return
        from hetrain.metrics import RankMetrics

        error = None
        try:
            metrics = RankMetrics(
                rank=self.rank, local_rank=self.local_rank, world_size=self.world_size, device=self.device,
                device_name=self.entry.device, port=self._metrics_port, run_dir=self.run_dir,
                job=os.environ.get("TORCHELASTIC_RUN_ID", "local"),
                predicted_step_seconds=self.entry.predicted_step_seconds)
        except HetrainError as e:
            error, metrics = e, None
        failed = torch.tensor([0.0 if error is None else 1.0 + self.rank], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)   # every rank stops with the same line, none hangs
        if error is not None:
            raise error
        if failed.item() > 0:
            raise HetrainError(f"rank {int(failed.item()) - 1} could not serve its metrics; see its line above "
                               "(--metrics-port)")
        self.add_observer(metrics)
        if self.restart_count:
            metrics.on_restart(self.restart_count)
        self._flop_meter = FlopMeter(self.prepared.module)


def _now() -> float:
    import time

    return time.perf_counter()


def _comm_bytes(comm_state: Any) -> dict[str, float]:
    stats = getattr(comm_state, "stats", None)
    take = getattr(stats, "take_step_bytes", None)
    return take() if callable(take) else {}


def _refuse_pipeline(plan: Plan) -> None:
    """Pipeline plans are not run yet: say so with the fix."""
    if plan.pipeline is not None or plan.strategy in PIPELINE_STRATEGIES or any(r.stage for r in plan.ranks):
        stages = len(plan.pipeline.stages) if plan.pipeline is not None else 1 + max(r.stage for r in plan.ranks)
        raise HetrainError(
            f"the plan runs a pipeline of {stages} stages (strategy {plan.strategy}); hetrain's runtime does not "
            "run pipeline stages yet. Re-plan with `hetrain plan --strategy balanced` (or zero1, zero3)"
        )
