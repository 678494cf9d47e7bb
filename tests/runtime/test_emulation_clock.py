"""An emulated device keeps its speed: sleeps that wake late do not slow it down over many steps."""

import pytest

from hetrain.runtime import timing
from hetrain.runtime.timing import SleepClock, pad_to_speed


class LateSleeper:
    """A clock whose every sleep wakes `late` seconds after it was due (as a real one does, ~0.1 ms)."""

    def __init__(self, late: float) -> None:
        self.now, self.late = 0.0, late

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.late


@pytest.fixture
def late_clock(monkeypatch):
    fake = LateSleeper(late=1e-4)
    monkeypatch.setattr(timing, "time", fake)
    monkeypatch.setattr(timing, "EMULATION_CLOCK", SleepClock())
    return fake


def test_many_short_waits_take_their_total_not_their_total_plus_each_lateness(late_clock):
    clock = SleepClock()
    taken = sum(clock.wait(0.002) for _ in range(500))
    assert late_clock.now == pytest.approx(taken)                 # what it reports is what it took
    assert abs(taken - 500 * 0.002) < 2e-4                        # a plain sleep would be 50 ms over


def test_pad_to_speed_takes_elapsed_over_speed_and_reports_the_time_it_took(late_clock):
    reported = 0.0
    for _ in range(200):
        reported += pad_to_speed(0.010, 0.5)          # 10 ms of work at half speed: 20 ms in all
    assert late_clock.now == pytest.approx(reported - 200 * 0.010)   # the reported waits are the real ones
    assert abs(reported - 200 * 0.020) < 2e-4
    assert pad_to_speed(0.010, 1.0) == 0.010 and pad_to_speed(0.010, None) == 0.010


class OnceLate(LateSleeper):
    """Wakes on time but once, `late` seconds after it was due (a loaded host)."""

    def __init__(self, late: float, at: int) -> None:
        super().__init__(0.0)
        self.once, self.at, self.calls = late, at, 0

    def sleep(self, seconds: float) -> None:
        self.calls += 1
        self.now += seconds + (self.once if self.calls == self.at else 0.0)


def test_one_late_wake_up_is_paid_back_without_leaving_steps_unpadded(monkeypatch):
    """Carried whole, a 20 ms late wake-up skipped the next twenty 1 ms waits: 17 of 20 steps unpadded, their
    median that of a full-speed rank."""
    fake = OnceLate(0.020, at=3)
    monkeypatch.setattr(timing, "time", fake)
    clock = SleepClock()
    taken = [clock.wait(0.001) for _ in range(120)]
    # each later wait pays back at most a quarter of its length (less the lateness it expects, at most 0.1 ms)
    assert min(taken[3:]) >= 0.00065, taken
    assert sum(taken) == pytest.approx(120 * 0.001, abs=1e-6)  # and over the run the speed is kept
