"""The line a launched rank ends with (Ctrl-C, a lost peer) names the script's own innermost frame."""

import sys

import torch

from hetrain.runtime.ending_lines import interrupted_line, peer_lost_line


def _scripts_loop():
    raise KeyboardInterrupt


def _caught(fn):
    try:
        fn()
    except KeyboardInterrupt:
        return sys.exc_info()[2]
    raise AssertionError("no KeyboardInterrupt")


def test_the_line_names_the_innermost_frame_outside_torch_and_hetrain():
    line = interrupted_line(_caught(_scripts_loop), "3")
    assert line.startswith("[hetrain rank 3] interrupted by SIGINT (Ctrl-C) in tests/runtime/test_ending_lines.py:"), line
    assert line.endswith("(_scripts_loop)"), line


def test_frames_inside_torch_and_hetrain_are_passed_over_for_the_scripts_own():
    """Interrupted inside torch's code (or hetrain's) that the script called: the line names the script's call."""
    import os
    from pathlib import Path

    import hetrain

    for library in (torch, hetrain):
        inside = compile("raise KeyboardInterrupt", os.path.join(Path(library.__file__).parent, "nn", "any.py"), "exec")

        def scripts_step():
            exec(inside, {})   # a frame whose code lies in the library's directory

        line = interrupted_line(_caught(scripts_step), "0")
        assert line.endswith("(scripts_step)") and "test_ending_lines.py:" in line, line


def test_without_a_traceback_the_line_names_no_place():
    assert interrupted_line(None, "1") == "[hetrain rank 1] interrupted by SIGINT (Ctrl-C)"


def test_a_lost_peer_is_said_with_the_error_and_where_the_script_waited():
    line = peer_lost_line("RuntimeError: Connection closed by peer [127.0.0.1]:1234", _caught(_scripts_loop), "0")
    assert line.startswith("[hetrain rank 0] stopped: it lost its connection to a peer in "
                           "tests/runtime/test_ending_lines.py:"), line
    assert "(_scripts_loop) (RuntimeError: Connection closed by peer [127.0.0.1]:1234); the launcher's last line " \
           "names the rank whose failure was the cause" in line, line


def test_a_collective_that_timed_out_is_not_called_a_lost_connection():
    """The peer it waited on may still be there, stalled: the rank says it waited, not that the peer is gone."""
    error = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms"
    line = peer_lost_line(error, _caught(_scripts_loop), "1")
    assert line.startswith("[hetrain rank 1] stopped: it waited on a peer past the collective timeout in "
                           "tests/runtime/test_ending_lines.py:"), line
    assert f"({error}); the launcher's last line names the rank whose failure was the cause" in line, line


def test_a_hetrain_error_that_reads_like_a_lost_peer_keeps_its_own_line(monkeypatch):
    """A bad-input error naming a refused connection is the rank's own error, not an echo of a peer's."""
    from hetrain.errors import HetrainError
    from hetrain.runtime.ending_lines import ending_line

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ending_line(HetrainError("metrics server: connection refused on port 9400"), None) is None
    assert ending_line(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), None).startswith(
        "[hetrain rank ")
