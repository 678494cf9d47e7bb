"""One-line refusals of hetrain k8s and hetrain bench recover name the fix that applies."""

import argparse

import pytest

from hetrain.bench import recover
from hetrain.cli.main import main
from hetrain.errors import HetrainError
from hetrain.planning.plan import Plan


def test_a_plan_path_that_is_a_directory_asks_for_the_plan_file(tmp_path):
    """'.' was "does not exist; write one with `hetrain plan --out .`", a command hetrain plan refuses."""
    with pytest.raises(HetrainError) as e:
        Plan.load(tmp_path)
    assert str(e.value) == (f"plan file {str(tmp_path)!r} is a directory; fix: give the plan's JSON file, e.g. the "
                            "plan.json that `hetrain plan --out plan.json` wrote")


def test_steps_that_end_before_the_default_kill_step_say_it_is_the_default():
    """--steps 2 alone was "--kill-step 14 must be between 1 and --steps - 1 (1)", a flag not given."""
    parser = argparse.ArgumentParser()
    recover.build_parser(parser)
    with pytest.raises(HetrainError, match=r"^--steps 2 ends before the default --kill-step 14 \(.*\); fix: --steps 15 "
                                           r"or more, or a smaller --interval, or --kill-step 1$"):
        recover.run(parser.parse_args(["--steps", "2"]))
    with pytest.raises(HetrainError, match=r"^--kill-step 3 must be between 1 and --steps - 1 \(1\)$"):
        recover.run(parser.parse_args(["--steps", "2", "--kill-step", "3"]))


def test_a_script_flag_before_the_double_dash_is_told_to_go_after_it(capsys):
    """`hetrain k8s ... --epochs 3` was only "unrecognized arguments: --epochs"."""
    with pytest.raises(SystemExit) as e:
        main(["k8s", "--image", "x", "--script", "t.py", "--epochs", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "unrecognized arguments: --epochs; a flag for the script goes after `--` (`hetrain k8s ... --script " \
           "train.py -- --epochs 3`)" in err
