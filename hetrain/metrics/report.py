"""A run's figures from its run log (RUN_DIR/metrics/rank-N.jsonl): per-rank series and a summary.

Pure functions over the logged lines. When a rank was restarted and ran some steps again, the
last run of each step counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

from hetrain.errors import HetrainError
from hetrain.metrics.run_log import find_logs, read_lines

CAUSES = ("compute", "waiting on ranks", "waiting for data", "script", "checkpoint")


@dataclass
class RankRun:
    """One rank's logged figures, steps in order."""

    rank: int
    start: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0

    @property
    def device(self) -> str:
        return str(self.start.get("device") or (self.steps[0]["device"] if self.steps else "?"))

    @property
    def timed(self) -> list[dict[str, Any]]:
        return [s for s in self.steps if s.get("step_seconds")]

    def samples_per_second(self) -> list[tuple[int, float]]:
        return [(s["step"], s["samples"] / s["step_seconds"]) for s in self.timed]

    def shares(self) -> list[tuple[int, float]]:
        return [(s["step"], s["share"] / sum(s["shares"])) for s in self.steps if s.get("shares")]

    def time_by_cause(self) -> dict[str, float]:
        """Seconds of the timed steps: computing, waiting on other ranks, waiting for data, the
        script's own time between steps (logging, evaluation), and checkpoint saves holding the loop."""
        t = self.timed
        return {"compute": sum(s["compute_seconds"] for s in t),
                "waiting on ranks": sum(s["waiting_seconds"] or 0.0 for s in t),
                "waiting for data": sum(s["data_wait_seconds"] for s in t),
                "script": sum(s.get("script_seconds", 0.0) for s in t),
                "checkpoint": sum(s.get("checkpoint_seconds", 0.0) for s in t)}


def load_run(run_dir: str | Path) -> dict[int, RankRun]:
    """rank -> RankRun from the run directory's logs; a one-line error when there are none."""
    logs = find_logs(run_dir)
    if not logs:
        raise HetrainError(f"no run log in {str(run_dir)!r} (looked for metrics/rank-N.jsonl); give the run "
                           f"directory a job wrote with HETRAIN_RUN_DIR or --checkpoint-dir set")
    runs = {}
    for rank, path in logs.items():
        run = RankRun(rank)
        by_step: dict[int, dict[str, Any]] = {}
        for line in read_lines(path):
            kind = line.get("kind")
            if kind == "start" and not run.start:
                run.start = line
            elif kind == "step":
                by_step[line["step"]] = line
            elif kind == "checkpoint":
                run.checkpoints.append(line)
            elif kind == "restart":
                run.restarts = max(run.restarts, int(line["count"]))
        run.steps = [by_step[k] for k in sorted(by_step)]
        runs[rank] = run
    return runs


def split_change_steps(runs: dict[int, RankRun]) -> list[int]:
    return sorted({s["step"] for r in runs.values() for s in r.steps if s.get("split_changed")})


def loss_series(runs: dict[int, RankRun]) -> list[tuple[int, float]]:
    """The global loss by step (every rank logs the same figure; the lowest rank's is taken)."""
    for run in runs.values():
        points = [(s["step"], s["loss"]) for s in run.steps if s.get("loss") is not None]
        if points:
            return points
    return []


def summary_rows(runs: dict[int, RankRun]) -> list[dict[str, Any]]:
    """One row per rank: what the report's table prints."""
    rows = []
    for rank, run in runs.items():
        t = run.timed
        step_seconds = sum(s["step_seconds"] for s in t)
        causes = run.time_by_cause()
        mfus = [s["mfu"] for s in t if s.get("mfu") is not None]
        last = run.steps[-1] if run.steps else {}
        sent = [s["comm_bytes"] for s in run.steps if s.get("comm_bytes")]
        rows.append({
            "rank": rank, "device": run.device, "steps": len(run.steps),
            "step_seconds": step_seconds / len(t) if t else None,
            "predicted_step_seconds": run.start.get("predicted_step_seconds"),
            "samples_per_second": sum(s["samples"] for s in t) / step_seconds if step_seconds else None,
            "share": last["share"] / sum(last["shares"]) if last.get("shares") else None,
            **{cause: causes[cause] / step_seconds if step_seconds else None for cause in CAUSES},
            "mfu": fmean(mfus) if mfus else None,
            # None where no step measured its traffic (FSDP2's collectives are not counted), never 0 for it
            "comm_bytes": sum(sum(d.values()) for d in sent) if sent else None,
            "checkpoints": len(run.checkpoints), "restarts": run.restarts,
            "emulated": any(s.get("emulated") for s in run.steps),
        })
    return rows
