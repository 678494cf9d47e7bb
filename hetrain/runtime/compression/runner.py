"""Run each bucket's collectives on one worker thread, in launch order.

A hook whose collectives depend on each other (quantise -> all-to-all -> re-quantise ->
all-gather) cannot launch the later ones from the main thread without blocking backward, and
launching them from completion callbacks lets the next bucket's collectives overtake them on
some ranks but not others: gloo and NCCL pair collectives by the order they are issued, so the
ranks would mismatch. One FIFO worker per hook state keeps every rank's order equal to DDP's
bucket order while backward keeps computing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class SerialRunner:
    """FIFO worker thread: ``submit(job)`` returns a Future set to ``job()``'s tensor."""

    def __init__(self, name: str = "hetrain-comm") -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._name = name
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], torch.Tensor]) -> torch.futures.Future:
        """Queue ``job``; the returned future completes with its result (or its exception)."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((job, fut))
        return fut

    def _loop(self) -> None:
        while True:
            job, fut = self._jobs.get()
            try:
                result = job()
            except BaseException as e:  # surface in the training loop instead of hanging it
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def __getstate__(self) -> dict:
        return {"_name": self._name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["_name"])
