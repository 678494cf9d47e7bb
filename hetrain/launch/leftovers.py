"""Nothing left behind: processes a job's workers started and left running end with the launcher.

A worker's children (DataLoader workers, helpers a training script starts) normally end with it.
One that cannot, such as a child stuck in `fork()` (CPython before 3.12 can deadlock a child forked
while another thread of the parent creates a Python thread state, python/cpython#112275), would
otherwise outlive the job, and keep its output pipe open: `hetrain launch ... | tee log` would never
return. The launcher adopts such orphans (Linux's child subreaper), and when the job ends it
kills every process that carries this launch's id in its environment and is still its child.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from hetrain.runtime.parent_death import prctl
from hetrain.vocabulary import Env

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> str:
    """Mark this launch's workers (through their environment) and adopt their orphans; returns the id."""
    launch_id = uuid.uuid4().hex
    os.environ[Env.LAUNCH_ID] = launch_id
    prctl(_PR_SET_CHILD_SUBREAPER, 1)
    return launch_id


def process_status(pid: int) -> tuple[str, int]:
    """(state letter, parent pid) of a process, from /proc (OSError when there is no such process)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    # the command name may hold spaces and parentheses: the fields after the last ')' are fixed
    state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
    return state.decode(), int(ppid)


def children_of_launch(launch_id: str) -> list[int]:
    """Live children of this process whose environment carries `launch_id`."""
    me, found = os.getpid(), []
    marker = f"{Env.LAUNCH_ID}={launch_id}".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            state, ppid = process_status(int(entry))
            if ppid != me or state == "Z":
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
        except (OSError, ValueError):
            continue
        found.append(int(entry))
    return found


def _reap(pid: int, timeout_s: float = 5.0) -> None:
    """Collect a killed child's exit status (only its own: other children of this process are not ours)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)


def end_leftovers(launch_id: str, rounds: int = 5) -> list[int]:
    """Kill and reap the processes this launch's workers left running; returns their pids. Killing
    one may orphan its own children onto this process, so it looks again a few times."""
    ended: list[int] = []
    for _ in range(rounds):
        pids = children_of_launch(launch_id)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append(pid)
            except ProcessLookupError:
                pass
        for pid in pids:
            _reap(pid)
    prctl(_PR_SET_CHILD_SUBREAPER, 0)
    if os.environ.get(Env.LAUNCH_ID) == launch_id:
        del os.environ[Env.LAUNCH_ID]
    return ended
