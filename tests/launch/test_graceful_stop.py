"""SIGTERM to the launcher goes to each rank alone, and the agent takes over once they have exited."""

import subprocess
import sys
import time
import uuid

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

from hetrain.launch.graceful_stop import GracefulStop, agent_signals, rank_pids
from hetrain.vocabulary import Env

SLEEPER = "import signal, sys, time\n{}\nprint('ready', flush=True)\ntime.sleep(60)\n"


def _rank(launch_id: str, ignore_sigterm: bool, *, new_session: bool = True) -> subprocess.Popen:
    setup = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_sigterm else ""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER.format(setup)], stdout=subprocess.PIPE, text=True,
                            env={Env.LAUNCH_ID: launch_id, "PATH": "/usr/bin:/bin"}, start_new_session=new_session)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_the_agent_keeps_every_signal_but_sigterm():
    assert agent_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGINT,SIGHUP,SIGQUIT"
    assert agent_signals(" SIGINT , SIGTERM") == "SIGINT"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_ranks_get_sigterm_alone_and_the_agent_takes_over_once_they_exit():
    launch_id = uuid.uuid4().hex
    rank = _rank(launch_id, ignore_sigterm=False)
    not_a_rank = _rank(launch_id, ignore_sigterm=False, new_session=False)   # in this process's group
    try:
        assert rank_pids(launch_id) == [rank.pid]
        stop = GracefulStop(launch_id, wait_s=20)
        t0 = time.monotonic()
        with pytest.raises(SignalException):
            stop.on_sigterm(15, None)
        assert time.monotonic() - t0 < 5          # returned once the rank exited, not after wait_s
        assert rank.wait(5) == -15 and not_a_rank.poll() is None
    finally:
        for p in (rank, not_a_rank):
            p.kill()
            p.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_a_rank_that_does_not_exit_holds_the_launcher_no_longer_than_the_wait():
    launch_id = uuid.uuid4().hex
    rank = _rank(launch_id, ignore_sigterm=True)
    try:
        stop = GracefulStop(launch_id, wait_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(SignalException):
            stop.on_sigterm(15, None)
        assert 1.0 <= time.monotonic() - t0 < 3 and rank.poll() is None
        t0 = time.monotonic()
        with pytest.raises(SignalException):    # a second SIGTERM hands over at once
            stop.on_sigterm(15, None)
        assert time.monotonic() - t0 < 0.5
    finally:
        rank.kill()
        rank.wait()


def test_the_launchers_last_line_claims_a_save_on_sigterm_only():
    """After Ctrl-C it said 'a hetrain.Session saves a checkpoint then': SIGINT stops the ranks unsaved."""
    import signal

    from hetrain.launch.launcher import stopped_line

    assert "saves the step in flight" in stopped_line(signal.SIGTERM)
    for sig in (signal.SIGINT, signal.SIGHUP):
        line = stopped_line(sig)
        assert "without saving" in line and "SIGTERM" in line and "saves" not in line, line
