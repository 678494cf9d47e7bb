"""A loader's worker processes leave a scheduler's SIGTERM to their rank.

A scheduler that ends a job (SLURM's time limit, `scancel`) may send SIGTERM to every process of it
at once, the rank's DataLoader workers included. A worker killed by it fails the rank's next batch
("DataLoader worker ... is killed by signal: Terminated") before the rank reaches the end of its
step, where a Session saves the step in flight. So the workers ignore SIGTERM: they serve the rank
until it has saved, and end with it. DataLoader ends them as it always does (its done event, or
their rank's death); what multiprocessing does at a process's exit, SIGTERM to each worker and a
join, would wait on workers that ignore it, so the rank tells its workers to end first: at its exit,
and when the loader is dropped. It tells them through a pipe each worker watches, which a worker
that has already ended cannot hold up.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

_LIVE: "weakref.WeakSet[LeaveSigtermToRank]" = weakref.WeakSet()


class LeaveSigtermToRank:
    """A DataLoader `worker_init_fn`: the worker ignores SIGTERM and ends when its rank says so, then the
    script's own `worker_init_fn` (if any) runs. A class, not a closure: spawned workers receive it
    pickled, with the pipe's end they watch."""

    def __init__(self, worker_init_fn: Callable[[int], Any] | None) -> None:
        self.worker_init_fn = worker_init_fn
        self._watched, writer = multiprocessing.Pipe(duplex=False)
        self.end_workers = weakref.finalize(self, _say_end, writer)   # also when the loader is dropped
        _LIVE.add(self)
        _at_exit()

    def __getstate__(self) -> dict[str, Any]:
        return {"worker_init_fn": self.worker_init_fn, "_watched": self._watched}

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        threading.Thread(target=_end_when_told, args=(self._watched,), name="hetrain-worker-end",
                         daemon=True).start()
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


def _end_when_told(watched: Any) -> None:
    try:
        watched.poll(None)   # readable once the rank wrote (the byte stays for every worker) or died
    finally:
        os._exit(0)


def _say_end(writer: Any) -> None:
    try:
        writer.send_bytes(b"\0")
        writer.close()
    except OSError:
        pass


def _rank_exiting() -> None:
    """At the rank's exit, before multiprocessing sends each worker SIGTERM and joins it: every worker
    of this process's loaders ends now."""
    for workers in list(_LIVE):
        workers.end_workers()


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
    empties its finalizers in a forked child)."""
    global _registered
    _registered = False
    for workers in list(_LIVE):
        detached = workers.end_workers.detach()
        if detached is not None:
            try:
                detached[2][0].close()   # the write end (`_say_end`'s argument)
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
