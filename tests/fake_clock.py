"""A clock for the session's timing tests that moves only when a test says so: what a step's parts add up
to is then exact, and no load on the machine running the tests (other pytest workers, their ranks) can move
a second from one part to another. A test stands in for the script's work, a device's compute or a save
with `clock.sleep(seconds)`, where it would sleep for real."""

from __future__ import annotations

import time as real_time
from typing import Any

import pytest

# the modules that time a step's parts, each through its own name `time`
TIMED_MODULES = ("hetrain.runtime.timing", "hetrain.runtime.step_clock", "hetrain.runtime.data",
                 "hetrain.runtime.fsdp_waits", "hetrain.runtime.pipeline_timing", "hetrain.runtime.resume",
                 "hetrain.checkpoint.checkpointer")


class FakeClock:
    """Stands in for the `time` module in TIMED_MODULES: perf_counter reads `now`, sleep moves it (an emulated
    speed's padding is one such sleep); anything else is the real module's (monotonic times deadlines: real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(real_time, name)


def install(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A FakeClock read by every module that times a step, and a fresh emulation clock (no carry of earlier
    real sleeps in this process)."""
    import importlib

    from hetrain.runtime import timing

    clock = FakeClock()
    for name in TIMED_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "time", clock)
    monkeypatch.setattr(timing, "EMULATION_CLOCK", timing.SleepClock())
    return clock
