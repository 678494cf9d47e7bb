"""Emulated speeds from the launcher's environment, on as many ranks as the job has now."""

import pytest

from hetrain.errors import HetrainError
from hetrain.runtime.timing import emulated_speed
from hetrain.vocabulary import Env


def test_an_elastic_job_back_on_fewer_ranks_keeps_each_ranks_speed(monkeypatch):
    """`--nnodes 1:2 --emulate-speeds 1,0.5` gives a speed per rank the job may have; after a
    restart on one rank, that rank runs at speed 1 (it stopped with 'give one speed per rank')."""
    monkeypatch.setenv(Env.EMULATE_SPEEDS, "1,0.5")
    assert emulated_speed(0, 1) == 1.0
    assert [emulated_speed(r, 2) for r in range(2)] == [1.0, 0.5]
    with pytest.raises(HetrainError, match="give one speed per rank"):
        emulated_speed(2, 3)
    monkeypatch.delenv(Env.EMULATE_SPEEDS)
    assert emulated_speed(0, 1) is None
