"""FSDP2's collectives, timed (hetrain.runtime.fsdp_waits): their seconds are not compute, and an emulated
speed pads each stretch of compute between two of them, as a slow device is slow in every block. On a fake
clock (tests/fake_clock.py): real sleeps of 0.05 s left 25 ms between a bound and a loaded machine's lateness."""

import pytest

from hetrain.runtime.fsdp_waits import CommWaits
from tests import fake_clock

STRETCH = 0.05


def test_a_collective_s_seconds_are_counted_and_the_compute_before_it_is_padded_to_the_speed(monkeypatch):
    clock = fake_clock.install(monkeypatch)
    waits = CommWaits(speed=0.5)
    waits.mark()                          # the step's compute begins
    started = clock.perf_counter()
    clock.sleep(STRETCH)                  # a block's compute
    waits.around(lambda: clock.sleep(STRETCH))   # its all-gather, waiting on a slower rank
    # the block took twice its time at speed 0.5, before the gather; the gather's own seconds are counted apart
    assert clock.perf_counter() - started == pytest.approx(3 * STRETCH)
    assert waits.since_mark() == pytest.approx(STRETCH)
    clock.sleep(STRETCH)                  # the last block's backward, after the last collective
    before_finish = clock.perf_counter()
    waits.finish()
    assert clock.perf_counter() - before_finish == pytest.approx(STRETCH)   # padded too
    before = clock.perf_counter()
    waits.around(lambda: None)            # an evaluation's gather between steps: no compute stretch to pad
    assert clock.perf_counter() - before == 0.0
    assert waits.since_mark() == pytest.approx(STRETCH)


def test_without_an_emulated_speed_nothing_is_padded(monkeypatch):
    clock = fake_clock.install(monkeypatch)
    waits = CommWaits()
    waits.mark()
    clock.sleep(STRETCH)
    before = clock.perf_counter()
    waits.around(lambda: None)
    waits.finish()
    assert clock.perf_counter() - before == 0.0
