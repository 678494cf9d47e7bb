"""Where the session meets the progress watch: the loader's phases, and meetings of every rank in the job's store.

`session.barrier()` meets in the store, not in a collective: work one rank does alone before it (rank 0
downloads the dataset while the others wait) may outlast the progress limit and the process group's
timeout, and the watch does not take ranks waiting there for a rank that still works and speaks for a
stall (`hetrain.runtime.watchdog.waits_on_work_before_a_barrier`). `session.model_state_dict()` under FSDP2
or a pipeline meets the same way before it gathers: a rank calling it alone waits there, named by the watch,
instead of pairing its gathers with the others' step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from hetrain.runtime.watchdog import ProgressWatch


def _watch_at(own: "ProgressWatch | None", next_step: Callable[[], int]) -> tuple["ProgressWatch | None", int]:
    """The session's watch and step; for a session without a watch of its own (a GAN's second, made once the
    process group was there), the process's running watch at its own step."""
    if own is not None:
        return own, next_step()
    current = ProgressWatch.current
    return current, current.step if current is not None else 0


def watch_loader(loader: Any, own: "ProgressWatch | None", next_step: Callable[[], int]) -> None:
    """The loader tells the watch when this rank reads its batch, computes its step, or its stream ended a
    pass (`next_step()`: the step the batch is for)."""
    def on_stream_end(ended: tuple[int, int] | None) -> None:
        watch, step = _watch_at(own, next_step)
        if watch is not None:
            watch.stream_end(ended, step)

    def on_phase(phase: str) -> None:
        watch, step = _watch_at(own, next_step)
        if watch is not None:
            {"reading": watch.reading, "between": watch.between}.get(phase, watch.computing)(step)

    loader.on_stream_end, loader.on_phase = on_stream_end, on_phase


def after_step(own: "ProgressWatch | None", next_step: int) -> None:
    """A step ended: the script's own code runs until the next batch is read (a second session's step too, or
    the phase its backward through the first one's model left, "waiting", would stand for the script's code)."""
    watch, step = _watch_at(own, lambda: next_step)
    if watch is not None:
        watch.between(step)


_meetings: dict[str, int] = {}   # meet() calls of this process by call: every rank makes them in one order


def meet(watch: "ProgressWatch | None", call: str = "barrier") -> None:
    """`session.barrier()`: every rank waits until each has reached it, however long that takes. Work one rank
    does alone before it (rank 0 downloads the dataset while the others wait) may outlast the progress limit
    and the process group's timeout, so the ranks meet in the job's store, not in a collective; ranks that
    wait here for a rank in the script's own code are not a stall (`waits_on_work_before_a_barrier`; one
    reading its batch, in a step or silent is named). Before a collective call (`call`)
    that a rank making it alone would pair with the others' step (FSDP2's gathers), the rank waits here,
    named, instead. Without a watch (one rank, no launcher's store), the process group's barrier."""
    watch = watch or ProgressWatch.current   # a second session of the process (a GAN's) has the first's
    if watch is None:
        dist.barrier()
        return
    _meetings[call] = _meetings.get(call, 0) + 1
    key = f"hetrain/meet/{call}/{_meetings[call]}"
    with watch.inside(call):
        if watch.store.add(key, 1) == watch.world_size:
            watch.store.set(f"{key}/all", "1")
        pause = 0.005
        while not watch.store.check([f"{key}/all"]):
            time.sleep(pause)
            pause = min(2 * pause, 0.5)
