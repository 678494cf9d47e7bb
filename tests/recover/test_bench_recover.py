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


def _measure_saves(rank, world, directory):
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import hetrain
    from hetrain.bench.recover_job import measure_saves

    torch.manual_seed(0)
    session = hetrain.Session(balance=False, checkpoint_dir=directory, checkpoint_interval=100)
    net = torch.nn.Linear(64, 32)
    model, _ = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    loader = session.loader(TensorDataset(torch.randn(32, 64), torch.randint(0, 32, (32,))), global_batch_size=8)
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        break
    figures = measure_saves(session, Path(directory) / "measure", 2)
    session.close()
    return figures


def test_the_save_costs_are_measured_on_the_session_s_own_state(tmp_path):
    """The job's `--measure-saves` part: the session's state saved synchronously and in the background."""
    from tests.distributed import run_ranks

    figures = run_ranks(_measure_saves, 2, str(tmp_path))
    for f in figures:
        # the weights and Adam's two moments of 64*32+32 floats each, besides the job's records
        assert f["bytes"] > 3 * (64 * 32 + 32) * 4, f
        assert f["repeats"] == 2 and f["sync_save_seconds"] > 0 and f["background_save_seconds"] > 0
        assert 0 <= f["blocking_seconds"] <= f["background_save_seconds"], f
    assert (tmp_path / "measure" / "sync").is_dir() and (tmp_path / "measure" / "background").is_dir()


def test_bench_recover_end_to_end_loses_at_most_the_interval_and_ends_on_the_same_parameters():
    """The whole command, small: a rank killed after step 8 under the elastic agent, checkpoints every 3."""
    import sys
    from pathlib import Path

    from tests.distributed import run_cli

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "hetrain.cli.main", "bench", "recover", "--json", "--steps", "12", "--interval", "3",
           "--hidden", "64", "--depth", "1", "--measure-saves", "1"]
    r = run_cli(cmd, cwd=root, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["kill_step"] == 8 and got["final_params_equal"] is True, got
    # the step-6 checkpoint, or step 3 when the step-6 save was still being written at the kill
    assert got["resumed_from_step"] in (3, 6) and got["steps_lost"] == 8 - got["resumed_from_step"], got
    assert got["recovery_seconds"] > 0 and got["checkpoint_bytes"] > 0 and got["checkpoint_save_seconds"] > 0, got
