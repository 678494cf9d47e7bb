"""Byte formulas, int8 quantisation and the hidden-fraction arithmetic (no processes)."""

import math

import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.planning.plan import CommPlan
from hetrain.runtime.comm_hooks import check_comm
from hetrain.runtime.compression import CommStats, dequantize, int8_bytes, quantize, topk_bytes
from hetrain.runtime.compression.stats import allgather_bytes, allreduce_bytes
from hetrain.runtime.hierarchical import validate_islands


def test_ring_formulas():
    assert allreduce_bytes(400, 2) == 400
    assert allreduce_bytes(400, 4) == 600
    assert allgather_bytes(400, 4) == 300
    assert allreduce_bytes(400, 1) == 0


def test_int8_and_topk_bytes_per_bucket():
    # 10_000 values on 4 ranks: shards of 2500 int8 + 5 fp32 scales, all-to-all and all-gather
    assert int8_bytes(10_000, 4, 512) == 2 * 3 * (2500 + 4 * 5)
    # 1% of 10_000 = 100 (index, value) pairs of 8 bytes, gathered from 4 ranks
    assert topk_bytes(10_000, 4, 0.01) == 3 * 100 * 8
    assert topk_bytes(10, 2, 0.01) == 8  # at least one entry


def test_quantize_round_trip_error_is_half_a_step_per_chunk():
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * torch.linspace(0.01, 10, 1000)
    q, scales = quantize(x, 256)
    assert q.dtype == torch.int8 and scales.shape == (3, math.ceil(1000 / 256))
    err = (dequantize(q, scales, 256) - x).abs()
    step = scales.repeat_interleave(256, dim=1)[:, :1000]
    assert torch.all(err <= step / 2 + 1e-7)
    assert torch.all(q.abs() <= 127)


def test_quantize_zero_chunk_gives_zeros():
    q, scales = quantize(torch.zeros(1, 10), 4)
    assert torch.count_nonzero(dequantize(q, scales, 4)) == 0


def test_hidden_fraction_counts_time_before_the_last_bucket():
    stats = CommStats()
    # bucket 0 launched at 0, done at 3; bucket 1 (last) launched at 2, done at 5; backward ends at 2
    stats._intervals = [[0.0, 3.0, 2.0], [2.0, 5.0, 2.0]]
    stats.steps = 1
    assert stats.hidden_fraction() == pytest.approx(2.0 / 5.0)
    assert stats.comm_seconds == pytest.approx(5.0)


def test_hidden_fraction_merges_overlapping_intervals_only_once():
    stats = CommStats()
    stats._intervals = [[0.0, 4.0, 1.0], [1.0, 2.0, 1.0], [6.0, 7.0, 1.0]]
    assert stats.hidden_fraction() == pytest.approx(1.0 / 5.0)


def test_powersgd_needs_two_warmup_steps_with_error_feedback():
    with pytest.raises(HetrainError, match="powersgd_warmup_steps=1"):
        check_comm(CommPlan(compression="powersgd", powersgd_warmup_steps=1))
    check_comm(CommPlan(compression="powersgd", powersgd_warmup_steps=1), powersgd_error_feedback=False)


@pytest.mark.parametrize("islands", [None, [[0, 1], [1, 2, 3]], [[0, 1], [2]], [[0, 1, 2, 3], []]])
def test_islands_must_cover_each_rank_once(islands):
    with pytest.raises(HetrainError, match="islands"):
        validate_islands(islands, 4)


def test_islands_are_sorted():
    assert validate_islands([[3, 2], [1, 0]], 4) == [[2, 3], [0, 1]]
