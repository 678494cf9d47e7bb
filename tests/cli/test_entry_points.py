"""The ways to start hetrain: `python -m hetrain`, `python -m hetrain.cli.demo`, and what `hetrain --help`
and `hetrain bench` with no name tell the user."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hetrain import __version__
from hetrain.cli.bench import BENCHES
from hetrain.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _python_m(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:   # argparse's own refusals exit
        return int(e.code)


def test_python_m_hetrain_is_the_hetrain_command():
    r = _python_m("hetrain", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hetrain {__version__}", r.stderr
    r = _python_m("hetrain", "devices", "--devices", "a100:2", "--json")
    assert r.returncode == 0 and '"a100' in r.stdout, r.stderr


def test_python_m_hetrain_cli_demo_builds_the_demo_s_parser():
    r = _python_m("hetrain.cli.demo", "--help")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "usage: hetrain demo" in r.stdout and "--speeds" in r.stdout


def test_help_lists_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "-V, --version" in out


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    assert _main(["bench"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "required" not in err and "rest" not in err, err
    assert all(name in lines[0] for name in BENCHES), err


def test_a_table_piped_into_a_reader_that_stops_ends_as_a_closed_pipe_quietly():
    """`hetrain plan ... | head -1`: rich's console exited 1, where a closed pipe ends a verb with 141 and
    nothing on stderr, as `hetrain devices --json | head` does (found auditing the CLI)."""
    p = subprocess.Popen([sys.executable, "-m", "hetrain.cli.main", "plan", "--preset", "a100x4+v100x4", "--model",
                          "resnet152", "--global-batch-size", "1024"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()   # the reader is gone before the table is written (a pipe buffer could hold all of it)
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and not err.strip(), err
