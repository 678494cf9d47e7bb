"""FSDP2's collectives, timed (hetrain.runtime.fsdp_waits): their seconds are not compute, and an emulated
speed pads each stretch of compute between two of them, as a slow device is slow in every block."""

import time

from hetrain.runtime.fsdp_waits import CommWaits

STRETCH = 0.05


def test_a_collective_s_seconds_are_counted_and_the_compute_before_it_is_padded_to_the_speed():
    waits = CommWaits(speed=0.5)
    waits.mark()                          # the step's compute begins
    started = time.perf_counter()
    time.sleep(STRETCH)                   # a block's compute
    waits.around(lambda: time.sleep(STRETCH))   # its all-gather, waiting on a slower rank
    took = time.perf_counter() - started
    # the block took twice its time at speed 0.5, before the gather; the gather's own seconds are counted apart
    assert took > 3 * STRETCH * 0.95, took
    assert STRETCH * 0.95 < waits.since_mark() < STRETCH * 1.5, waits.since_mark()
    time.sleep(STRETCH)                   # the last block's backward, after the last collective
    before_finish = time.perf_counter()
    waits.finish()
    assert time.perf_counter() - before_finish > STRETCH * 0.9   # padded too
    before = time.perf_counter()
    waits.around(lambda: None)            # an evaluation's gather between steps: no compute stretch to pad
    assert time.perf_counter() - before < STRETCH / 2


def test_without_an_emulated_speed_nothing_is_padded():
    waits = CommWaits()
    waits.mark()
    time.sleep(STRETCH)
    before = time.perf_counter()
    waits.around(lambda: None)
    waits.finish()
    assert time.perf_counter() - before < STRETCH / 2
