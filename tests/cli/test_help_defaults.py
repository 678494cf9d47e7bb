"""--help of hetrain simulate, profile, k8s, demo and every benchmark names each option's default
as the code has it, and says what every option is for."""

import argparse
import importlib

import pytest

from hetrain.cli.bench import BENCHES
from hetrain.cli.main import main

VERBS = {"simulate": "hetrain.cli.simulate", "profile": "hetrain.cli.profile", "k8s": "hetrain.cli.k8s",
         "demo": "hetrain.cli.demo", **{f"bench {name}": f"hetrain.bench.{name}" for name in BENCHES}}


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())   # unwrapped: a default may fall across a line break


@pytest.mark.parametrize("command", sorted(VERBS))
def test_every_option_says_what_it_is_for_and_its_default(command, capsys):
    text = _help(command, capsys)
    parser = argparse.ArgumentParser()
    importlib.import_module(VERBS[command]).build_parser(parser)
    for action in parser._actions:
        if not action.option_strings or action.default == argparse.SUPPRESS:   # --help
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no description"
        if action.default not in (None, False, []) and "(default" not in action.help:
            assert f"(default: {action.default})" in text, f"{command} {action.option_strings[0]}"


@pytest.mark.parametrize("command, defaults", [
    ("simulate", ["--sizes SIZES how many copies of the mix, comma-separated (default: 1,2,4,8,16,32)",
                  "(default: 8)", "Gb/s (default: 100.0)", "x devices (default: 64)", "(default: simulate)"]),
    ("profile", ["comma-separated (default: 1,2,4,8)", "(the median counts) (default: 10)",
                 "slow model takes longer (default: 5.0)", "share the CPU (default: 1)"]),
    ("k8s", ["runs on (default: 1)", "after a failure (default: 3)", "per pod (default: 1)",
             "(default: /checkpoints)"]),
    ("bench comm", ["SGD learning rate (momentum 0.9) (default: 0.05)", "(default: 2)", "(default: 10)",
                    "(default: 0.01)", "and the batches (default: 0)"]),
    ("demo", ["samples per step, split over the ranks (default: 512)"]),
])
def test_the_defaults_the_docs_give_are_in_help(command, defaults, capsys):
    text = _help(command, capsys)
    for default in defaults:
        assert default in text, default
