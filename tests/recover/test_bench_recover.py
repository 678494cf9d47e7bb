"""`hetrain bench recover`'s reading of the job's event files: steps lost and the recovery timeline."""

import json

import pytest

from hetrain.bench.recover import read_events, recovery_figures
from hetrain.errors import HetrainError


def _write(directory, rank, events):
    directory.mkdir(exist_ok=True)
    (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _ev(event, t, restart, **fields):
    return {"event": event, "t": t, "restart": restart, **fields}


def test_recovery_runs_from_the_death_to_the_first_step_after_the_restart(tmp_path):
    first = [_ev("step", 10.0 + s / 10, 0, step=s) for s in range(1, 15)]
    _write(tmp_path, 0, first + [_ev("start", 13.0, 1), _ev("ready", 15.0, 1), _ev("prepared", 16.0, 1),
                                 _ev("resumed", 16.5, 1, step=10), _ev("step", 16.7, 1, step=11),
                                 _ev("step", 16.8, 1, step=12)])
    _write(tmp_path, 1, [_ev("death", 11.45, 0, step=14), _ev("start", 13.2, 1), _ev("ready", 15.1, 1),
                         _ev("prepared", 16.1, 1), _ev("resumed", 16.6, 1, step=10)])
    got = recovery_figures(read_events(tmp_path))
    assert got["kill_step"] == 14 and got["resumed_from_step"] == 10 and got["steps_lost"] == 4
    assert got["recovery_seconds"] == pytest.approx(16.7 - 11.45)
    # the parts add up to the whole, each measured to the later of the two new processes
    parts = ("detect_and_restart_seconds", "startup_seconds", "build_seconds", "resume_seconds", "first_step_seconds")
    assert sum(got[p] for p in parts) == pytest.approx(got["recovery_seconds"])
    assert got["detect_and_restart_seconds"] == pytest.approx(13.2 - 11.45)


def test_a_run_without_a_restart_is_reported(tmp_path):
    _write(tmp_path, 0, [_ev("step", 1.0, 0, step=1)])
    with pytest.raises(HetrainError, match="death"):
        recovery_figures(read_events(tmp_path))
    _write(tmp_path, 1, [_ev("death", 1.5, 0, step=1)])
    with pytest.raises(HetrainError, match="restart"):
        recovery_figures(read_events(tmp_path))
