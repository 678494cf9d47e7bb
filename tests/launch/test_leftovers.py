"""A job leaves nothing running: a process a worker started and abandoned ends with `hetrain launch`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import run_cli, run_ranks

ROOT = Path(__file__).resolve().parents[2]

ABANDONS_A_CHILD = """
import subprocess, sys
# a child in a session of its own, holding the job's stdout, that the worker never waits for
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
print("worker done", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="adopting orphans is Linux's child subreaper")
def test_a_process_a_worker_abandoned_ends_with_the_launcher(tmp_path):
    script = tmp_path / "abandons.py"
    script.write_text(ABANDONS_A_CHILD)
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "1", str(script),
                 str(pid_file)], cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "worker done" in r.stdout
    pid = int(pid_file.read_text())
    assert not _alive(pid), f"the abandoned child {pid} outlived the job"
    assert "ended 1 process(es) the workers left running" in r.stderr
    assert time.monotonic() - started < 100


def test_run_cli_does_not_wait_for_a_leftover_holding_the_output(tmp_path):
    pid_file = tmp_path / "leftover.pid"
    started = time.monotonic()
    try:
        with pytest.raises(AssertionError, match="still holds its output open 2 s later"):
            run_cli(["sh", "-c", f"setsid sleep 60 & echo $! > {pid_file}; echo done"], timeout=30, grace=2)
        assert time.monotonic() - started < 15
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(["sh", "-c", "sleep 60"], timeout=1, grace=2)
    assert time.monotonic() - started < 15


def _one_rank_dies(rank: int, world: int) -> int:
    import os

    if rank == 1:
        os._exit(5)
    return rank


def test_run_ranks_fails_at_once_when_a_rank_ends_without_reporting():
    """A rank that dies hard (no exception to report) fails the test with its exit code, not a hang."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 exit code 5"):
        run_ranks(_one_rank_dies, 2, timeout=60)
    assert time.monotonic() - start < 30
