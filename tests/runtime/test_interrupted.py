"""The line a launched rank stopped by Ctrl-C prints names the script's own innermost frame."""

import sys

import torch

from hetrain.runtime.interrupted import interrupted_line


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
    assert line.startswith("[hetrain rank 3] interrupted by SIGINT (Ctrl-C) in tests/runtime/test_interrupted.py:"), line
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
        assert line.endswith("(scripts_step)") and "test_interrupted.py:" in line, line


def test_without_a_traceback_the_line_names_no_place():
    assert interrupted_line(None, "1") == "[hetrain rank 1] interrupted by SIGINT (Ctrl-C)"
