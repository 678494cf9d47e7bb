"""SIGTERM to `hetrain launch` reaches each rank alone; the agent stops the job once they have saved.

torch's elastic agent stops its workers by signalling each one's whole process group, and a rank's
group holds its DataLoader worker processes too. Those die of the signal at once, and the rank's
loader raises ("DataLoader worker ... is killed by signal: Terminated") before the session reaches
the end of its step: the save that SIGTERM asks for never happens, and every step since the last
periodic checkpoint is lost.

So the launcher takes SIGTERM itself. It sends it to each rank process alone (its loader workers
keep serving it), waits until every rank has exited (a hetrain.Session saves the step in flight and
exits with 143, ending its own workers) or `wait_s` has passed, and only then hands the signal to
the agent, which stops whatever is left as it always does. A second SIGTERM hands it over at once.
SIGUSR1, which a scheduler may send as a warning before the end (Slurm's
`--signal=USR1@N`) and whose default action would kill the launcher at once, is taken as SIGTERM.
SIGINT, SIGHUP and SIGQUIT stay the agent's. Where /proc is missing (not Linux) the launcher finds
no ranks and hands the signal over at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

from hetrain.launch.leftovers import children_of_launch, process_status
from hetrain.runtime.stop_signals import takes_usr1

STOP_WAIT_S = 30.0
"""How long the ranks get to save and exit before the agent stops them (its own SIGKILL follows 30 s
after that)."""


def rank_pids(launch_id: str) -> list[int]:
    """This launch's live ranks: children of this process carrying the launch id that lead their own
    process group (the agent starts each rank in a new session; its DataLoader workers are not)."""
    pids = []
    for pid in children_of_launch(launch_id):
        try:
            if os.getpgid(pid) == pid:
                pids.append(pid)
        except ProcessLookupError:
            pass
    return pids


def _running(pid: int) -> bool:
    """Whether `pid` has not exited (a zombie, exited but not yet collected by the agent, has)."""
    try:
        return process_status(pid)[0] != "Z"
    except (OSError, ValueError):
        return False


def agent_signals(value: str) -> str:
    """The signals the agent takes over when it starts the workers (torchrun's `--signals-to-handle`,
    `value`), without SIGTERM: the launcher handles that one."""
    return ",".join(s.strip() for s in value.split(",") if s.strip() and s.strip() != "SIGTERM")


class GracefulStop:
    """While installed, SIGTERM goes to the ranks first (see the module's docstring)."""

    def __init__(self, launch_id: str, wait_s: float = STOP_WAIT_S) -> None:
        self.launch_id = launch_id
        self.wait_s = wait_s
        self._stopping = False
        self._previous = None
        self._previous_usr1 = None

    def install(self) -> bool:
        """Take SIGTERM (from the main thread only); the agent must be started without it
        (`agent_signals`), or it takes it back when it starts the workers."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self.on_sigterm)
        if takes_usr1():   # a scheduler's warning before the end (Slurm's --signal=USR1@N): a SIGTERM stop
            self._previous_usr1 = signal.signal(signal.SIGUSR1, self.on_sigterm)
        return True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._previous_usr1 is not None:
            signal.signal(signal.SIGUSR1, self._previous_usr1)
            self._previous_usr1 = None

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing import SignalException

        sigval = signal.SIGTERM   # SIGUSR1 too: the ranks save and stop, and the job ends with 143
        if not self._stopping:
            self._stopping = True
            pids = rank_pids(self.launch_id)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + self.wait_s
            while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
