"""A run's figures from its run log (RUN_DIR/metrics/rank-N.jsonl): per-rank series and a summary.

Pure functions over the logged lines. Each `start` line begins an attempt (a launch, or a restart of
the workers); when a rank ran some steps again after resuming, the last run of each step counts. A
rank that resumed on another device gets one summary row per device, each with the figures of the
steps it ran there and the start line in force for them (its plan's predicted step time). Lines
that are not a whole record (not a JSON object, a step line without its figures) are skipped: a
damaged line never replaces a good one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetrain.errors import HetrainError
from hetrain.metrics.run_log import find_logs, read_lines

CAUSES = ("compute", "waiting on ranks", "waiting for data", "script", "checkpoint")

_NUMBERS = ("time", "samples", "share", "compute_seconds", "data_wait_seconds")     # a step line needs these
_NULLABLE = ("step_seconds", "waiting_seconds")                                   # present, a number or null
_OPTIONAL = ("loss", "mfu", "script_seconds", "checkpoint_seconds", "items")       # a number or null when present
# what a step line keeps once read (the report, its plot and the TensorBoard export read no more): a long run's
# lines read whole took about 4.5 KB each (2.67 GB for two ranks of 300,000 steps)
_KEPT = ("step", "device", *_NUMBERS, *_NULLABLE, *_OPTIONAL, "shares", "comm_bytes", "emulated", "split_changed")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def complete_step(line: dict[str, Any]) -> bool:
    """Whether a step line holds every figure the report reads, each of its type."""
    if type(line.get("step")) is not int or not isinstance(line.get("device"), str):
        return False
    if not all(_number(line.get(k)) for k in _NUMBERS):
        return False
    if not all(k in line and (line[k] is None or _number(line[k])) for k in _NULLABLE):
        return False
    if not all(line.get(k) is None or _number(line[k]) for k in _OPTIONAL):
        return False
    shares, sent = line.get("shares", []), line.get("comm_bytes", {})
    return (isinstance(shares, list) and all(_number(x) for x in shares)
            and isinstance(sent, dict) and all(_number(x) for x in sent.values()))


@dataclass
class Attempt:
    """One process's stay in the log: from its start line to the next."""

    start: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0
    first_device: str | None = None   # the device of its first step, for a log that lost its start line
    first_step: int | None = None     # the first step it logged: a resumed attempt's checkpoint is the one before
    unlogged: set[int] = field(default_factory=set)   # steps it committed a checkpoint at that a later one resumed
    last_time: float | None = None    # when it logged its last step

    @property
    def device(self) -> str | None:
        device = self.start.get("device")
        return device if isinstance(device, str) else self.first_device


@dataclass
class RankRun:
    """One rank's logged figures, steps in order; `step_attempts[i]` is the attempt that ran `steps[i]`."""

    rank: int
    attempts: list[Attempt] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    step_attempts: list[int] = field(default_factory=list)
    mixed_emulation: bool = False   # a part of a rank that ran at emulated speeds and without
    log: Path | None = None
    skipped_lines: int = 0          # lines of its log that are not whole records, passed over

    @property
    def start(self) -> dict[str, Any]:
        """The start line in force for the last step (the last start line when no step was logged)."""
        if self.step_attempts:
            return self.attempts[self.step_attempts[-1]].start
        return self.attempts[-1].start if self.attempts else {}

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        return [c for a in self.attempts for c in a.checkpoints]

    @property
    def checkpoint_steps(self) -> list[int]:
        """The steps a checkpoint was committed at: those logged, and those a later attempt resumed from (a
        background save that committed just before its process was killed logged nothing)."""
        logged = {c.get("step") for c in self.checkpoints}
        resumed = {step for a in self.attempts for step in a.unlogged}
        return sorted(s for s in logged | resumed if isinstance(s, int) and not isinstance(s, bool))

    @property
    def restarts(self) -> int:
        """Attempts that were restarts (each launch counts its own from 1: a second launch's first restart is 1)."""
        return sum(1 for a in self.attempts if a.restarts > 0)

    @property
    def devices(self) -> list[str]:
        """The devices this rank's steps ran on, in order of first use (`cpu (emulated)` for emulated speeds
        where the rank also ran without)."""
        seen = list(dict.fromkeys(self._where(s) for s in self.steps))
        return seen or [d for d in dict.fromkeys(a.device for a in self.attempts) if d][-1:]

    def _where(self, step: dict[str, Any]) -> str:
        mixed = self.mixed_emulation or len({bool(s.get("emulated")) for s in self.steps}) > 1
        return step["device"] + (" (emulated)" if mixed and step.get("emulated") else "")

    @property
    def device(self) -> str:
        return " → ".join(self.devices) or "?"

    def parts(self) -> list["RankRun"]:
        """One RankRun per device this rank ran on (itself when only one): its steps and attempts there. A
        rank that ran at emulated speeds and without (a resume on fewer ranks, launched without) gets a part
        for each: their timings are not of one device."""
        devices = self.devices
        if len(devices) <= 1:
            return [self]
        parts = []
        for device in devices:
            picked = [(s, a) for s, a in zip(self.steps, self.step_attempts) if self._where(s) == device]
            used = sorted({a for _, a in picked} | {i for i, a in enumerate(self.attempts) if a.device == device})
            index = {a: j for j, a in enumerate(used)}
            parts.append(RankRun(self.rank, [self.attempts[a] for a in used], [s for s, _ in picked],
                                 [index[a] for _, a in picked], self.mixed_emulation or
                                 len({bool(s.get("emulated")) for s in self.steps}) > 1))
        return parts

    @property
    def timed(self) -> list[dict[str, Any]]:
        return [s for s in self.steps if s.get("step_seconds")]

    def samples_per_second(self) -> list[tuple[int, float]]:
        return [(s["step"], s["samples"] / s["step_seconds"]) for s in self.timed]

    def shares(self) -> list[tuple[int, float]]:
        return [(s["step"], s["share"] / sum(s["shares"])) for s in self.steps if s.get("shares") and sum(s["shares"])]

    def time_by_cause(self) -> dict[str, float]:
        """Seconds of the timed steps: computing, waiting on other ranks, waiting for data, the
        script's own time between steps (logging, evaluation), and checkpoint saves holding the loop."""
        t = self.timed
        return {"compute": sum(s["compute_seconds"] for s in t),
                "waiting on ranks": sum(s["waiting_seconds"] or 0.0 for s in t),
                "waiting for data": sum(s["data_wait_seconds"] for s in t),
                "script": sum(s.get("script_seconds") or 0.0 for s in t),
                "checkpoint": sum(s.get("checkpoint_seconds") or 0.0 for s in t)}


def read_rank(rank: int, path: Path) -> RankRun:
    """One rank's log: its attempts and each step's last complete run."""
    run = RankRun(rank, log=path)
    by_step: dict[int, tuple[dict[str, Any], int]] = {}

    def skipped() -> None:
        run.skipped_lines += 1

    for line in read_lines(path, skipped):
        kind = line.get("kind")
        whole_step = kind == "step" and complete_step(line)
        if kind == "step" and not whole_step:
            skipped()
        if kind == "start" or not run.attempts:
            run.attempts.append(Attempt(start=line if kind == "start" else {}))
        attempt = run.attempts[-1]
        if whole_step:
            attempt.last_time = line["time"] if _number(line.get("time")) else attempt.last_time
            line = {k: line[k] for k in _KEPT if k in line}
            by_step[line["step"]] = (line, len(run.attempts) - 1)
            attempt.first_device = attempt.first_device or line["device"]
            attempt.first_step = line["step"] if attempt.first_step is None else attempt.first_step
        elif kind == "checkpoint":
            attempt.checkpoints.append(line)
        elif kind == "restart" and _number(line.get("count")):
            attempt.restarts = max(attempt.restarts, int(line["count"]))
    ordered = [by_step[k] for k in sorted(by_step)]
    run.steps = [line for line, _ in ordered]
    run.step_attempts = [a for _, a in ordered]
    ran = {line["step"]: a for line, a in ordered}   # the checkpoint a later attempt resumed from: its writer's
    for later in run.attempts[1:]:
        if isinstance(later.first_step, int) and later.first_step - 1 in ran:
            run.attempts[ran[later.first_step - 1]].unlogged.add(later.first_step - 1)
    return run


def load_run(run_dir: str | Path) -> dict[int, RankRun]:
    """rank -> RankRun from the run directory's logs; a one-line error when there are none, or when no
    rank logged a step."""
    logs = find_logs(run_dir)
    if not logs:
        raise HetrainError(f"no run log in {str(run_dir)!r} (looked for metrics/rank-N.jsonl); give the run "
                           f"directory a job wrote with `hetrain launch --run-dir` (HETRAIN_RUN_DIR) or "
                           f"--checkpoint-dir set")
    runs = drop_rolled_back({rank: read_rank(rank, path) for rank, path in logs.items()})
    if not any(run.steps for run in runs.values()):
        raise HetrainError(f"no step was logged in {str(run_dir)!r}: {len(runs)} rank log(s) but none holds a "
                           "finished step (the job stopped before its first step ended); see the job's own output")
    return runs


def drop_rolled_back(runs: dict[int, RankRun]) -> dict[int, RankRun]:
    """Without the steps an attempt logged that a later attempt of another world size resumed before (it began
    after the first's last step, at a step the first had run): a rank that left when the job resumed on fewer
    ranks (the ranks that stayed ran those steps again). A rank left with no step (a new run from step 1 in
    the same directory, without it) is not in the result."""
    resumes = [(a.start["time"], a.first_step, a.start.get("world_size")) for run in runs.values()
               for a in run.attempts if _number(a.start.get("time")) and isinstance(a.first_step, int)]

    def taken_back(attempt: Attempt, step: int) -> bool:
        ended = attempt.last_time
        return _number(ended) and any(when > ended and step >= first and world != attempt.start.get("world_size")
                                      for when, first, world in resumes)

    kept = {}
    for rank, run in runs.items():
        keep = [i for i, (s, a) in enumerate(zip(run.steps, run.step_attempts))
                if not taken_back(run.attempts[a], s["step"])]
        if len(keep) < len(run.steps):
            if not keep:
                continue
            run.steps, run.step_attempts = [run.steps[i] for i in keep], [run.step_attempts[i] for i in keep]
        kept[rank] = run
    return kept


def split_change_steps(runs: dict[int, RankRun]) -> list[int]:
    """The last step of each split the loader used (the next step used another): a split the balancer
    decides reaches the loader `lag` steps later. Logs without the split a step used give the steps
    where the balancer decided."""
    steps: set[int] = set()
    for run in runs.values():
        used = sorted((s["step"], tuple(s["shares"])) for s in run.steps if s.get("shares"))
        if not used:
            steps |= {s["step"] for s in run.steps if s.get("split_changed")}
        steps |= {a for (a, before), (_, after) in zip(used, used[1:]) if before != after}
    return sorted(steps)


def loss_series(runs: dict[int, RankRun]) -> list[tuple[int, float]]:
    """The global loss by step (every rank logs the same figure; the lowest rank's is taken)."""
    for run in runs.values():
        points = [(s["step"], s["loss"]) for s in run.steps if s.get("loss") is not None]
        if points:
            return points
    return []


def summary_row(run: RankRun) -> dict[str, Any]:
    """What the report's table prints for one rank on one device."""
    t = run.timed
    step_seconds = sum(s["step_seconds"] for s in t)
    causes = run.time_by_cause()
    # over the steps MFU is known for: their model FLOPs over their wall time (each step's MFU weighted by its
    # time), what the gauge's figures add up to; a step at 0 samples counts as the time it took
    mfu_steps = [s for s in t if s.get("mfu") is not None]
    mfu_seconds = sum(s["step_seconds"] for s in mfu_steps)
    last = run.steps[-1] if run.steps else {}
    sent = [s["comm_bytes"] for s in run.steps if s.get("comm_bytes")]
    return {
        "rank": run.rank, "device": run.device, "steps": len(run.steps),
        "first_step": run.steps[0]["step"] if run.steps else None, "last_step": last.get("step"),
        "step_seconds": step_seconds / len(t) if t else None,
        "predicted_step_seconds": run.start.get("predicted_step_seconds"),
        "samples_per_second": sum(s["samples"] for s in t) / step_seconds if step_seconds else None,
        # items (a token-mean loss's tokens, num_items): the work of a step whose samples vary in length
        "items_per_second": items_per_second(run),
        "share": last["share"] / sum(last["shares"]) if last.get("shares") and sum(last["shares"]) else None,
        **{cause: causes[cause] / step_seconds if step_seconds else None for cause in CAUSES},
        "mfu": sum(s["mfu"] * s["step_seconds"] for s in mfu_steps) / mfu_seconds if mfu_seconds else None,
        # None where no step measured its traffic (FSDP2's collectives are not counted), never 0 for it
        "comm_bytes": sum(sum(d.values()) for d in sent) if sent else None,
        "checkpoints": len(run.checkpoint_steps), "restarts": run.restarts,
        "emulated": any(s.get("emulated") for s in run.steps),
        **{key: run.start.get(key) for key in PLACE},
    }


PLACE = ("stage", "stages", "replica", "replicas")
"""A pipeline rank's place, from the start line in force for its last step (counted from 0; absent off a pipeline)."""


def items_per_second(run: RankRun) -> float | None:
    """Items over the seconds of the timed steps that counted them: not those the rank ran as a pipeline stage before
    the last (which computes no loss and counts no items; a resume may have moved the rank to another stage)."""
    counted = [s for s, a in zip(run.steps, run.step_attempts)
               if s.get("step_seconds") and not before_last_stage(run.attempts[a].start)]
    seconds = sum(s["step_seconds"] for s in counted)
    if not seconds or any(s.get("items") is None for s in counted):
        return None
    return sum(s["items"] for s in counted) / seconds


def before_last_stage(start: dict[str, Any]) -> bool:
    return start.get("stage") is not None and start.get("stages") is not None and start["stage"] < start["stages"] - 1


def summary_rows(runs: dict[int, RankRun]) -> list[dict[str, Any]]:
    """One row per rank, or per rank and device for a rank that resumed on another device."""
    return [summary_row(part) for run in runs.values() for part in run.parts()]
