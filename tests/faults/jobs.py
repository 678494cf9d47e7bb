"""Run a `hetrain launch` job for a test and never leave a process behind.

torch's agent starts each worker in a session of its own, so killing the launcher's process group
does not reach them, and a worker that outlives its launcher keeps output pipes open. So output
goes to files, the job's processes are noted (through /proc) while it runs, and whichever of them
is still alive at the end is killed by its pid and reported as left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def _start_time(pid: int) -> str | None:
    """The start time of a live process (None: gone, or a zombie): tells it from a later one of the same pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


@dataclass
class Job:
    pid: int
    """the launcher's"""
    returncode: int
    stdout: str
    stderr: str
    left_behind: list[int]
    """processes of the job still alive after its launcher ended (killed since)"""
    ended: float = 0.0
    """when the launcher ended (time.time())"""


def run_job(cmd: list[str], *, cwd: Path, env: dict, timeout: float, grace: float = 5.0) -> Job:
    """Run `cmd`; raises TimeoutExpired (after killing every process of the job) if it runs past `timeout`.

    Processes still alive `grace` seconds after the launcher ended count as left behind.
    """
    seen: dict[int, str | None] = {}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                for pid in descendants(proc.pid):
                    seen.setdefault(pid, _start_time(pid))
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.2)
            ended = time.time()
            end = time.monotonic() + grace
            while time.monotonic() < end and any(_start_time(p) == t for p, t in seen.items()):
                time.sleep(0.1)
        finally:
            left = [p for p, t in seen.items() if t is not None and _start_time(p) == t]
            for pid in [*left, proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        return Job(proc.pid, proc.returncode, out.read(), err.read(), left, ended)
