"""A rank under `hetrain launch` stopped by Ctrl-C says where it was, in one line.

The terminal sends SIGINT to every rank of the job at once, and the agent sends it again: each rank's
KeyboardInterrupt traceback (torch's frames, with a peer's closed connection as its cause on the
others) buried the launcher's last line, which says what the stop means for the job (no save; the
newest checkpoint is the last one saved). The line names the innermost frame of the script's own
code, where the traceback's useful part was.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from types import TracebackType

import torch

import hetrain

_LIBRARIES = tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (torch, hetrain))


def _shown(path: str) -> str:
    """`path` relative to the working directory where it lies below it, else as it is."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else path
    except (OSError, ValueError):
        return path


def interrupted_line(tb: TracebackType | None, rank: str) -> str:
    """'[hetrain rank R] interrupted by SIGINT (Ctrl-C) in FILE:LINE (FUNCTION)', naming the innermost frame
    outside torch and hetrain (the innermost of all where every frame is theirs)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    own = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_LIBRARIES)]
    at = (own or frames)[-1] if frames else None
    where = f" in {_shown(at.filename)}:{at.lineno} ({at.name})" if at is not None else ""
    return f"[hetrain rank {rank}] interrupted by SIGINT (Ctrl-C){where}"
