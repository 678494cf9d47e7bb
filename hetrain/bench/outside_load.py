"""Outside load for `hetrain bench balance --outside-load`: another program busy on one rank's core.

On a shared machine other jobs come and go. This stands for them: a process pinned to one CPU core
that spins in bursts (0.3 to 1 s) with idle gaps between them (0.5 to 2 s), drawn from a seed so a
run can be repeated. Ranks are pinned one per core, so the burst slows exactly one rank while it
lasts, and the balancer should not follow it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time


def pin_to_core(core: int) -> bool:
    """Pin this process to one CPU core (modulo the cores it may use); False where that is not possible."""
    try:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[core % len(cores)]})
        return True
    except (AttributeError, OSError):
        return False


def _burn(core: int, seed: int, stop) -> None:
    pin_to_core(core)
    rng = random.Random(seed)
    while not stop.is_set():
        end = time.perf_counter() + rng.uniform(0.3, 1.0)
        while time.perf_counter() < end and not stop.is_set():
            pass
        stop.wait(rng.uniform(0.5, 2.0))


class OutsideLoad:
    """A spinning process on `core`, in seeded bursts, until `stop()`."""

    def __init__(self, core: int, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._process = ctx.Process(target=_burn, args=(core, seed, self._stop), daemon=True)

    def start(self) -> "OutsideLoad":
        self._process.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
