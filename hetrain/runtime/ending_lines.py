"""The one line a rank under `hetrain launch` ends with, in place of a traceback that buried the launcher's.

- Ctrl-C: the terminal sends SIGINT to every rank of the job at once (and the agent sends it again), and
  each rank printed its KeyboardInterrupt traceback: torch's frames, with a peer's closed connection as
  its cause on the others, above the launcher's line that says what the stop means for the job.
- A peer's failure: every other rank's collective loses its connection (or waits past its timeout), and
  each printed that traceback beside the failed rank's own, which is the one to read; the launcher's line
  names that rank.

Each line names the innermost frame of the script's own code, the part of the traceback that told where
the rank was; the whole traceback stays in the rank's failure record.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path
from types import TracebackType

import torch

import hetrain
from hetrain.errors import HetrainError
from hetrain.runtime.failure_record import is_peer_loss, one_line

_LIBRARIES = tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (torch, hetrain))


def _shown(path: str) -> str:
    """`path` relative to the working directory where it lies below it, else as it is."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else path
    except (OSError, ValueError):
        return path


def where(tb: TracebackType | None) -> str:
    """' in FILE:LINE (FUNCTION)': the innermost frame outside torch and hetrain (the innermost of all where
    every frame is theirs); '' without a traceback."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    own = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_LIBRARIES)]
    at = (own or frames)[-1] if frames else None
    return f" in {_shown(at.filename)}:{at.lineno} ({at.name})" if at is not None else ""


def interrupted_line(tb: TracebackType | None, rank: str) -> str:
    """'[hetrain rank R] interrupted by SIGINT (Ctrl-C) in FILE:LINE (FUNCTION)'."""
    return f"[hetrain rank {rank}] interrupted by SIGINT (Ctrl-C){where(tb)}"


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def peer_lost_line(error: str, tb: TracebackType | None, rank: str) -> str:
    """'[hetrain rank R] stopped: it lost its connection to a peer in FILE:LINE (FUNCTION) (ERROR); ...', or, where
    the error is a timeout, that it waited on a peer past the timeout (the peer may still be there)."""
    what = "it waited on a peer past the collective timeout" if _TIMED_OUT.search(error) else \
        "it lost its connection to a peer"
    return (f"[hetrain rank {rank}] stopped: {what}{where(tb)} ({error}); the launcher's last line names the rank "
            "whose failure was the cause")


def ending_line(error: BaseException, tb: TracebackType | None) -> str | None:
    """A launched rank's one line in place of its traceback, or None where the traceback is the one to read (a
    HetrainError has its own line)."""
    rank = os.environ.get("RANK", "0")
    if isinstance(error, HetrainError):
        return None
    if isinstance(error, KeyboardInterrupt):
        return interrupted_line(tb, rank)
    if is_peer_loss(error) and os.environ.get("WORLD_SIZE", "1") != "1":
        return peer_lost_line(one_line(error), tb, rank)
    return None
