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
