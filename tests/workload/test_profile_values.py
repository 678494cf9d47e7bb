"""hetrain profile refuses a --seconds or --seq-len it cannot time with, before any model is built."""

import argparse

import pytest

from hetrain.cli import profile as profile_cli
from hetrain.errors import HetrainError
from hetrain.workload.modules import hf_module


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profile_cli.build_parser(parser)
    return parser.parse_args(["--out", "unused", *argv])


@pytest.mark.parametrize("seconds", ["nan", "inf"])
def test_a_seconds_budget_that_is_not_finite_is_refused(seconds):
    """--seconds nan passed `seconds <= 0` and profiled (rc 0)."""
    with pytest.raises(HetrainError, match=rf"^--seconds {seconds}: give a finite number of seconds"):
        profile_cli._check_flags(_args("--model", "resnet50", "--seconds", seconds))


@pytest.mark.parametrize("seq_len", ["0", "-4"])
def test_a_seq_len_below_1_is_refused_with_the_flag_that_fixes_it(seq_len):
    """--seq-len 0 profiled at the config's own 64 tokens and wrote seq_len 64; -4 was told to fix make_input(n)."""
    with pytest.raises(HetrainError, match=rf"^--seq-len {seq_len}: the sequence length must be at least 1; fix:"):
        profile_cli._check_flags(_args("--hf-config", "gpt2", "--seq-len", seq_len))
    with pytest.raises(HetrainError, match=rf"^--seq-len {seq_len}: the sequence length must be at least 1"):
        hf_module("gpt2", int(seq_len))
