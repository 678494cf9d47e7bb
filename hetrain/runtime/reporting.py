"""What a session reports: step records to its observers (metrics exporter, run log), the rates it
measured by device kind (`measured-rates.json`), and the model's FLOPs per item for MFU.

Observers are objects with `on_step(StepRecord)` and, optionally, `on_checkpoint(CheckpointRecord)`,
`on_restart(count)` and `close()`; they receive records and never reach into the session.
"""

from __future__ import annotations

import logging
import operator
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetrain.checkpoint import lease
from hetrain.errors import HetrainError
from hetrain.metrics.events import CheckpointRecord, StepRecord
from hetrain.metrics.serve import check_port_range, local_world_size
from hetrain.runtime.companions import earlier_companion
from hetrain.runtime.measured import FlopMeter, rates_by_kind
from hetrain.vocabulary import Env

log = logging.getLogger("hetrain")

RATES_EVERY_S = 30.0   # measured-rates.json is rewritten at most this often, and at each checkpoint and close


def run_directory(checkpoint_dir: str | None) -> Path | None:
    """Where a run's own files go (measured rates, run log): HETRAIN_RUN_DIR (`hetrain launch --run-dir`),
    else the checkpoint directory, else none; absolute, so a script that changes directory keeps it."""
    chosen = os.environ.get(Env.RUN_DIR) or checkpoint_dir
    return Path(chosen).absolute() if chosen else None


def metrics_port_setting(given: Any) -> int | None:
    """Session(metrics_port=), else HETRAIN_METRICS_PORT (0 or unset: none), checked when the session is
    made: this node's local ranks serve PORT..PORT+N-1, all of which must be TCP ports."""
    if given is None:
        value = os.environ.get(Env.METRICS_PORT, "").strip()
        if value in ("", "0"):
            return None
        if not value.isdigit():
            raise HetrainError(f"{Env.METRICS_PORT}={value!r} is not a port; set it to a whole number "
                               "from 1024 to 65535, or unset it")
        given, given_as = int(value), f"{Env.METRICS_PORT}={{}}"
    else:
        try:
            port = None if isinstance(given, bool) else operator.index(given)   # an int, a NumPy integer
        except TypeError:
            port = None
        if port is None:
            raise HetrainError(f"Session(metrics_port={given!r}): the base port is a whole number, e.g. 9400 "
                               "(each local rank serves base + its local rank), or None for no metrics")
        if port == 0:   # as HETRAIN_METRICS_PORT=0: none
            return None
        given, given_as = port, "Session(metrics_port={})"
    check_port_range(given, local_world_size(), given_as)
    return given


def metrics_beside(port: int | None, given: bool, run_dir: Path | None, first_port: int | None,
                   first_run_dir: Path | None, local_ranks: int) -> tuple[int | None, Path | None]:
    """The base port and run directory of a session made beside an earlier one of this process that is still open
    (a GAN's second session, hetrain.runtime.companions): the first keeps the job's ports and run log, so this one
    serves only a base port the script gave it (`Session(metrics_port=)`) whose ports are none of the first's, and
    writes only to a run directory that is not the first's (its own checkpoint_dir, without --run-dir)."""
    apart = first_port is None or (port is not None and abs(port - first_port) >= local_ranks)
    return (port if given and apart else None), (run_dir if run_dir != first_run_dir else None)


def start_metrics(session: Any) -> None:
    """Prometheus on the session's metrics port, and the run log (hetrain report) wherever the run has a directory;
    a session made beside an earlier open one leaves the first's to it (`metrics_beside`), saying so on rank 0."""
    port, run_dir, first = session.metrics_port, session.run_dir, earlier_companion(session)
    if first is not None:
        port, run_dir = metrics_beside(port, session.metrics_port_given, run_dir, first.metrics_port, first.run_dir,
                                       local_world_size())
        missing = ([f"on the metrics ports {session.metrics_port}.."] if port != session.metrics_port else []) + \
            ([f"in the run log {session.run_dir / 'metrics'}"] if run_dir != session.run_dir else [])
        if missing and session.is_main:
            log.info("this session was made beside an earlier one of this process (two models trained side by side): "
                     "the first's figures are the job's, this one's are not %s (Session(metrics_port=) of its own, "
                     "apart from the first's ports, serves them)", " nor ".join(missing))
    session.reports.run_dir = run_dir   # where its measured rates go too
    if port is None and run_dir is None:
        return
    session.reports.start_metrics(
        port=port, rank=session.rank, local_rank=session.local_rank, world_size=session.world_size,
        device=session.device, device_name=session.entry.device, precision=session.precision,
        emulated=session.emulated, job=os.environ.get("TORCHELASTIC_RUN_ID", "local"),
        restart_count=session.restart_count, predicted_step_seconds=plan_step_seconds(session.plan),
        module=session.prepared.module, whole_model=session.pipeline is None, place=pipeline_place(session.layout),
        # a stand-in piece (FSDP2) reads 0 samples; a pipeline stage computes its replica's batch whatever it read,
        # in its chunks (torch calls them, not the rank's module that holds them all), but not in shape inference
        carries_samples=(lambda state=session.state: state.current_samples() != 0) if session.pipeline is None
        else (lambda runner=session.pipeline: runner.carries_samples()),
        counted=session.pipeline.chunks if session.pipeline is not None else None)


def pipeline_place(layout: Any) -> dict[str, int] | None:
    """A pipeline rank's stage and replica (counted from 0) and how many there are; None off a pipeline."""
    if layout is None:
        return None
    return {"stage": layout.stage, "stages": len(layout.replica_ranks()), "replica": layout.replica,
            "replicas": len(layout.grid)}


def plan_step_seconds(plan: Any) -> float | None:
    """The plan's predicted step time (its global batch over its predicted samples/s: compute, the
    communication it leaves exposed, the bubble), the same on every rank; None without a prediction.
    A rank entry's `predicted_step_seconds` is that rank's compute only."""
    if plan is None or not plan.predicted_samples_per_s:
        return None
    return plan.global_batch_size / plan.predicted_samples_per_s


def step_record(session: Any, totals: Any, times: Any, compute: float, data_wait: float, applied: bool,
                changed: bool, grad_norm: float | None) -> StepRecord:
    """The record of a step a session just finished (`totals`: its StepTotals, `times`: its StepTimes)."""
    shares = session.train.loader.current_shares
    share, samples = shares[session.rank], totals.local_samples
    if session.pipeline is not None:   # a stage runs its replica's whole batch, read spread over the replica's ranks
        share, samples = sum(shares[r] for r in session.layout.replica_ranks()), session.pipeline.step_samples
    return StepRecord(
        step=session.train.step, rank=session.rank, world_size=session.world_size, device=session.entry.device,
        precision=session.precision, share=share, samples=samples,
        items=int(totals.local_items), global_samples=totals.global_samples, global_items=int(totals.global_items),
        step_seconds=times.wall, compute_seconds=compute, data_wait_seconds=data_wait,
        optimizer_seconds=session.timer.last_optimizer_s, loss=totals.loss, grad_norm=grad_norm,
        loss_scale=session.scaler.scale, skipped=not applied, skipped_total=session.skips.total,
        shares=tuple(shares), split_changed=changed, comm_bytes=comm_bytes(session.prepared.comm_state),
        emulated=session.emulated, script_seconds=times.script, checkpoint_seconds=times.checkpoint,
        model_flops=session.reports.take_step_flops())


class Reports:
    """A rank's observers and the files it writes for other tools."""

    def __init__(self, run_dir: Path | None, *, is_main: bool) -> None:
        self.run_dir = run_dir
        self.is_main = is_main
        self.observers: list[Any] = []
        self._flop_meter: FlopMeter | None = None
        self._rates: tuple | None = None             # the newest rates not yet written
        self._rates_written: float | None = None     # when they were last written (monotonic seconds)
        self.model_params: int | None = None         # of the model the rates are measured on
        self._release_lease: weakref.finalize | None = None   # gives back rank 0's hold on the run directory

    def add(self, observer: Any) -> None:
        self.observers.append(observer)

    def start_metrics(self, *, port: int | None, rank: int, local_rank: int, world_size: int, device: torch.device,
                      device_name: str, job: str, predicted_step_seconds: float | None, restart_count: int,
                      module: torch.nn.Module, whole_model: bool = True, precision: str | None = None,
                      emulated: bool = False, carries_samples: Callable[[], bool] = lambda: True,
                      counted: list[torch.nn.Module] | None = None, place: dict[str, int] | None = None) -> None:
        """Serve this rank's Prometheus metrics on `port` (None: none) and append its run log to the run
        directory, if any (collective: every rank stops with one line if any cannot). `carries_samples`: whether
        the forward now running computes samples (not a stand-in piece), for the model FLOPs MFU counts, in the
        forwards of `counted` (a pipeline rank's chunks; `module` when None). `place`: a pipeline rank's stage and
        replica (`pipeline_place`), in its run log's start line and its hetrain_rank_info."""
        from hetrain.metrics import RankMetrics

        # the rates a run saves hold for its model: --from-run compares (a pipeline stage holds part of it)
        self.model_params = sum(p.numel() for p in module.parameters()) if whole_model else None

        error = None
        if self.is_main and self.run_dir is not None:   # one job at a time appends to a run directory's logs
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                key = lease.hold(self.run_dir, "run directory")
                # given back at close(), or when the process exits without it (a script that raised)
                self._release_lease = weakref.finalize(self, lease.let_go, key)
            except HetrainError as e:
                error = e
            except OSError as e:
                error = HetrainError(f"cannot write the run directory {self.run_dir} ({e.strerror}); pass a writable "
                                     "--run-dir")
        _stop_together(error, rank, device, "could not take the run directory")   # before any rank writes there
        try:
            metrics = RankMetrics(rank=rank, local_rank=local_rank, world_size=world_size, device=device,
                                  device_name=device_name, port=port, run_dir=self.run_dir, job=job,
                                  predicted_step_seconds=predicted_step_seconds, precision=precision, emulated=emulated,
                                  place=place)
        except HetrainError as e:
            error = e
        _stop_together(error, rank, device, "could not serve its metrics or write its run log")
        self.add(metrics)
        if restart_count:
            metrics.on_restart(restart_count)
        self._flop_meter = FlopMeter(counted or module, carries_samples)

    def take_step_flops(self) -> float | None:
        """The model FLOPs of the step's forwards of samples (for its record), when counted."""
        return self._flop_meter.take_step_flops() if self._flop_meter is not None else None

    def step(self, record: StepRecord) -> None:
        for observer in self.observers:
            observer.on_step(record)

    def checkpoint(self, record: CheckpointRecord) -> None:
        self._write_rates()   # a run's rates are saved with its checkpoints
        for observer in self.observers:
            hook = getattr(observer, "on_checkpoint", None)
            if hook is not None:
                hook(record)

    def save_rates(self, entries, balancer, *, step: int, emulated: bool) -> None:
        """Rank 0 keeps the rates measured so far by device kind for `hetrain plan --from-run`: written
        at once the first time, then at most every RATES_EVERY_S seconds, at each checkpoint and at
        close (a write every re-split would stall rank 0, and every rank waiting for it, each time)."""
        if not self.is_main or self.run_dir is None or balancer.costs is None:
            return
        self._rates = (entries, balancer, step, emulated)
        if self._rates_written is None or time.monotonic() - self._rates_written >= RATES_EVERY_S:
            self._write_rates()

    def _write_rates(self) -> None:
        if self._rates is None:
            return
        entries, balancer, step, emulated = self._rates
        self._rates, self._rates_written = None, time.monotonic()
        rates = rates_by_kind(entries, balancer.costs, balancer.shares, step=step,
                              global_batch_size=sum(balancer.shares), emulated=emulated,
                              model_params=self.model_params)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            rates.save(self.run_dir)
        except OSError as e:
            log.warning("measured rates not written to %s (%s)", self.run_dir, e)

    def close(self) -> None:
        """Close every observer, then give back what the session holds, even when an observer's close() raises;
        the first error is raised after all of it (the next session can take the port and the run directory)."""
        errors = []
        for closer in [self._write_rates] + [getattr(o, "close", None) for o in self.observers]:
            try:
                if closer is not None:
                    closer()
            except Exception as e:  # noqa: BLE001 - raised below, once everything is closed
                errors.append(e)
        self.observers = []
        if self._flop_meter is not None:   # its hooks leave the script's model (a model prepared again keeps none)
            self._flop_meter.remove()
            self._flop_meter = None
        if self._release_lease is not None:
            self._release_lease()
            self._release_lease = None
        for later in errors[1:]:
            log.warning("an observer's close() raised too: %r", later)
        if errors:
            raise errors[0]


def _stop_together(error: HetrainError | None, rank: int, device: torch.device, what: str) -> None:
    """Collective: raise `error` on its rank and a line naming that rank on the others (no rank waits in a
    collective for one that stopped)."""
    failed = torch.tensor([0.0 if error is None else 1.0 + rank], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item() > 0:
        raise HetrainError(f"rank {int(failed.item()) - 1} {what}; see its line above")


def comm_bytes(comm_state: Any) -> dict[str, float]:
    """Bytes the comm hook sent since the last step, by level (empty without a counting hook)."""
    stats = getattr(comm_state, "stats", None)
    take = getattr(stats, "take_step_bytes", None)
    return take() if callable(take) else {}
