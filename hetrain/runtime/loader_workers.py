"""A loader's worker processes leave a scheduler's SIGTERM to their rank.

A scheduler that ends a job (SLURM's time limit, `scancel`) may send SIGTERM to every process of it
at once, the rank's DataLoader workers included. A worker killed by it fails the rank's next batch
("DataLoader worker ... is killed by signal: Terminated") before the rank reaches the end of its
step, where a Session saves the step in flight. So the workers ignore SIGTERM: they serve the rank
until it has saved, and end with it. DataLoader ends them as it always does (its done event, or
their rank's death); what multiprocessing does at a process's exit, SIGTERM to each worker and a
join, would wait on workers that ignore it, so the rank tells its workers to end first: at its exit,
and when the loader is dropped. It tells them through a pipe each worker watches, which a worker
that has already ended cannot hold up. A worker that cannot hear it (stuck in a call that holds the
interpreter lock, which its listening thread needs) is killed after `WORKER_EXIT_WAIT_S` at the rank's
exit, as multiprocessing's SIGTERM would have ended it: each worker tells its rank its pid and start time.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hetrain")

WORKER_EXIT_WAIT_S = 2.0   # how long a rank's exit waits for its told workers before it kills them
_PID = struct.Struct("=iq")   # what a worker writes its rank: its pid and start time, one atomic write to a pipe

_LIVE: "weakref.WeakSet[LeaveSigtermToRank]" = weakref.WeakSet()
_TOLD: set[tuple[int, int]] = set()   # (pid, start time) of the workers this process has told to end


class LeaveSigtermToRank:
    """A DataLoader `worker_init_fn`: the worker ignores SIGTERM and ends when its rank says so, then the
    script's own `worker_init_fn` (if any) runs. A class, not a closure: spawned workers receive it
    pickled, with the pipe's end they watch."""

    def __init__(self, worker_init_fn: Callable[[int], Any] | None) -> None:
        self.worker_init_fn = worker_init_fn
        self._watched, writer = multiprocessing.Pipe(duplex=False)
        pids, self._pid_to_rank = multiprocessing.Pipe(duplex=False)
        self.end_workers = weakref.finalize(self, _say_end, writer, pids)   # also when the loader is dropped
        _LIVE.add(self)
        _at_exit()

    def __getstate__(self) -> dict[str, Any]:
        return {"worker_init_fn": self.worker_init_fn, "_watched": self._watched, "_pid_to_rank": self._pid_to_rank}

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if hasattr(signal, "SIGUSR1"):   # a scheduler's warning signal, which the rank takes as SIGTERM
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        _tell_pid(self._pid_to_rank.fileno())
        threading.Thread(target=_end_when_told, args=(self._watched,), name="hetrain-worker-end",
                         daemon=True).start()
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


def _end_when_told(watched: Any) -> None:
    try:
        watched.poll(None)   # readable once the rank wrote (the byte stays for every worker) or died
    finally:
        os._exit(0)


def _tell_pid(fd: int) -> None:
    """Without blocking: a pipe that a rank never read fills after thousands of workers (a loader without
    persistent workers starts new ones each epoch); a worker whose pid is lost is only not killed if stuck."""
    try:
        os.set_blocking(fd, False)
        os.write(fd, _PID.pack(os.getpid(), start_time(os.getpid())))
    except OSError:
        pass


def start_time(pid: int) -> int:
    """When process `pid` started (clock ticks since boot, from /proc), -1 where that cannot be read: a pid
    alone names another process once the worker has been reaped and its pid reused."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


def _read_pids(pids: Any) -> set[tuple[int, int]]:
    fd = pids.fileno()
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            break
        if not chunk:
            break
        data += chunk
    return set(_PID.iter_unpack(data[: len(data) - len(data) % _PID.size]))


def _say_end(writer: Any, pids: Any) -> None:
    try:
        writer.send_bytes(b"\0")
        writer.close()
    except OSError:
        pass
    try:
        _TOLD.update(_read_pids(pids))
        pids.close()
    except OSError:
        pass
    running = {p.pid for p in multiprocessing.active_children()}   # those not yet ended
    _TOLD.intersection_update(told for told in _TOLD if told[0] in running)


def end_workers_left(told: set[tuple[int, int]], wait_s: float) -> int:
    """Join this process's children that are among the `told` workers (pid and start time: a worker reaped
    long ago may have left its pid to a process of the script's own) for up to `wait_s` together, then kill
    those still running; returns how many it killed."""
    children = [p for p in multiprocessing.active_children()   # without /proc (-1 both sides): the pid alone
                if p.pid is not None and (p.pid, start_time(p.pid)) in told]
    deadline = time.monotonic() + wait_s
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in children if p.exitcode is None]
    if stuck and hasattr(signal, "SIGCHLD") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # DataLoader's handler would raise that a worker was killed
    for p in stuck:
        p.kill()
    for p in stuck:
        p.join(1.0)
    return len(stuck)


def _rank_exiting() -> None:
    """At the rank's exit, before multiprocessing sends each worker SIGTERM and joins it: every worker
    of this process's loaders ends now, or is killed if it has not ended within `WORKER_EXIT_WAIT_S`."""
    for workers in list(_LIVE):
        workers.end_workers()
    killed = end_workers_left(_TOLD, WORKER_EXIT_WAIT_S)
    _TOLD.clear()
    if killed:
        log.warning("killed %d DataLoader worker(s) that had not ended %.0f s after their rank's exit began "
                    "(stuck in a call that holds the interpreter lock?)", killed, WORKER_EXIT_WAIT_S)


_registered = False


def _at_exit() -> None:
    """Run `_rank_exiting` as multiprocessing's exit begins, once: a finalizer it runs before it ends the
    process's children, both at an interpreter's exit and at the end of a process multiprocessing
    started (a rank started by torch.multiprocessing.spawn, whose exit runs no atexit hook)."""
    global _registered
    if not _registered:
        multiprocessing.util.Finalize(None, _rank_exiting, exitpriority=100)
        _registered = True


def _forked() -> None:
    """In a process forked from this one (a loader's worker, a rank started by fork): the parent's loaders
    are not its own. It drops their write ends, so that their workers see the pipe end when the parent
    dies however it dies (SIGKILL, os._exit), and registers its own exit hook anew (multiprocessing
    empties its finalizers in a forked child). What it inherited is frozen (`gc.freeze`) first: a model of an
    earlier session left in a reference cycle holds its process group, whose destructor, run by a collection
    here, waits on threads the fork did not copy, and the worker (and its rank, waiting for a batch) hung.
    The parent collects that garbage itself."""
    global _registered
    gc.freeze()
    _registered = False
    _TOLD.clear()
    for workers in list(_LIVE):
        detached = workers.end_workers.detach()
        if detached is not None:
            try:
                detached[2][0].close()   # the write end (`_say_end`'s first argument)
            except OSError:
                pass
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def with_sigterm_left_to_rank(dataloader_options: dict[str, Any]) -> dict[str, Any]:
    """DataLoader options whose workers (if any) leave a scheduler's SIGTERM to their rank."""
    if not dataloader_options.get("num_workers"):
        return dataloader_options
    return {**dataloader_options, "worker_init_fn": LeaveSigtermToRank(dataloader_options.get("worker_init_fn"))}
