"""tests.distributed.run_cli on a command that runs past its timeout: the failure says where each of its
processes was (a hang in CI is diagnosed from its report alone), and nothing of the command is left."""

import sys
import textwrap
import time

import pytest

from tests.distributed import CommandTimedOut, run_cli

# a parent and a child in a session of its own, as the launcher starts its ranks, each asleep in a function
# that names it; the child says its pid once it is there
CHILD = "import time\ndef child_sleeps_past_the_timeout():\n    time.sleep(120)\nchild_sleeps_past_the_timeout()\n"
PARENT = textwrap.dedent(f"""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], start_new_session=True)
    print(child.pid, flush=True)
    def parent_waits_for_its_child():
        time.sleep(120)
    parent_waits_for_its_child()
""")


def running(pid: int, wait_s: float = 10.0) -> bool:
    """Whether `pid` still runs `wait_s` seconds on (a killed process takes a moment to go; one its parent never
    reaped is a zombie until init reaps it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return False
        except FileNotFoundError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


def test_a_command_past_its_timeout_fails_naming_where_each_process_was():
    with pytest.raises(CommandTimedOut) as got:
        run_cli([sys.executable, "-c", PARENT], timeout=8, grace=2)
    said = str(got.value)
    assert "timed out after 8 seconds" in said
    assert "in parent_waits_for_its_child" in said and "in child_sleeps_past_the_timeout" in said, said
    child = int(got.value.output.split()[0])
    assert f"=== pid {child} " in said   # each stack under its process's line
    assert not running(child)   # killed with the rest, though not in the command's process group

