"""The CLI's tables on a terminal of a given width: whole figures on a narrow one, a table on a wide one."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.metrics.test_report import write_run

ROOT = Path(__file__).resolve().parents[2]
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def in_terminal(columns: int, *args: str) -> str:
    """What ``hetrain ARGS`` shows on a terminal ``columns`` wide (stdout and stderr a pseudo-terminal)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "hetrain.cli.main", *args], stdin=follower, stdout=follower,
                            stderr=follower, cwd=ROOT, env=env, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:   # the terminal closed: the command ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    return _ANSI.sub("", b"".join(chunks).decode().replace("\r\n", "\n"))


PLAN = ("plan", "--preset", "a100x4+v100x4", "--model", "resnet152", "--global-batch-size", "1024")


def test_a_plan_on_a_narrow_terminal_shows_every_figure_whole():
    out = in_terminal(60, *PLAN)
    assert "…" not in out
    for line in ("device              a100-sxm4-80gb", "device              v100-sxm2-32gb",
                 "memory used / total 19.4 / 80.0 GB", "micro-batch x accum 177 x 1"):
        assert line in out, out
    wide = in_terminal(200, *PLAN)
    assert "┃ ranks" in wide and "│ a100-sxm4-80gb │" in wide and "…" not in wide


def test_a_run_report_on_a_narrow_terminal_shows_every_figure_whole(tmp_path):
    write_run(tmp_path)
    out = in_terminal(60, "report", str(tmp_path))
    assert "…" not in out
    assert out.count("wait ranks") == 2 and "predicted step s" in out, out
    wide = in_terminal(200, "report", str(tmp_path))
    assert "…" not in wide and len([line for line in wide.splitlines() if "wait ranks" in line]) == 1


@pytest.mark.parametrize("args", [("devices", "--catalog"), ("devices",)])
def test_device_tables_on_a_narrow_terminal_cut_no_word(args):
    assert "…" not in in_terminal(60, *args)


def test_records_fold_a_word_longer_than_the_terminal_and_print_brackets_as_text():
    import io

    from rich.console import Console

    from hetrain.cli.console import print_rows

    out = io.StringIO()
    console = Console(file=out, width=40, color_system=None)
    path = "/very/long/path/to/a/measured/run/directory/of/this/job"
    print_rows(console, ["device", "run directory", "samples/s"] + [f"figure {i}" for i in range(6)],
               [["gpu[x] [bold]b[/bold]", path, "12.5"] + ["1.0"] * 6], title="t")
    text = out.getvalue()
    assert "…" not in text and "".join(text.split()).count(path) == 1, text
    assert "gpu[x] [bold]b[/bold]" in text, text
