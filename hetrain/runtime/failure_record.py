"""Why a rank ended, for the launcher: one line in the error file torch's elastic agent gives each worker.

`record_failure()` / `record_exception()` write it (TORCHELASTIC_ERROR_FILE) with the time to the microsecond and
whether it is only the echo of a peer's death (a closed connection); the launcher reads these
(`read_failure_record`) to name the rank that failed first. `one_line()` is the form a failure takes there.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from dataclasses import dataclass
from typing import Any

from hetrain.errors import HetrainError

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
RECORD_KEY = "hetrain"

_PEER_LOSS = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|remote process exited|"
    r"communicator was aborted|timed out waiting|socket timeout|connection refused|"
    r"ProcessGroup.*(aborted|shut ?down)", re.IGNORECASE)


@dataclass(frozen=True)
class FailureRecord:
    """Why one rank ended, as its error file tells."""

    message: str
    time: float
    """seconds since the epoch when the rank recorded it"""
    secondary: bool = False
    """the echo of a peer's failure (its connection closed), not a cause"""
    blame: int | None = None
    """the rank this record names as the cause (a stall report), if not the writer"""


def is_peer_loss(exc: BaseException) -> bool:
    """Whether `exc` only says that a peer rank is gone (a collective lost its connection)."""
    return bool(_PEER_LOSS.search(f"{type(exc).__name__}: {exc}"))


def one_line(exc: BaseException) -> str:
    """`Type: the message's first paragraph` on one line (a sentence wrapped over lines stays whole;
    torch's C++ frames after it are left out), at most 300 characters (a HetrainError whole), then hetrain's
    notes on its cause.
    A DataLoader worker's error is told by its own last lines (type, message, notes), not torch's wrapper."""
    message, kind = str(exc).strip(), type(exc).__name__
    hints = [n.removeprefix("hetrain: ") for n in getattr(exc, "__notes__", ()) if n.startswith("hetrain: ")]
    head, sep, original = message.partition("\nOriginal Traceback (most recent call last):\n")
    if sep and head.startswith("Caught ") and " in DataLoader worker process " in head:   # torch's wrapper
        lines = original.splitlines()
        frames = [i for i, t in enumerate(lines) if t.startswith('  File "')]
        start = frames[-1] + 1 if frames else 0
        while start < len(lines) and lines[start][:1].isspace():   # the frame's code line and carets
            start += 1
        tail = lines[start:]   # the worker's own "Type: message" (with its lines) and notes
        if tail and tail[0].strip():
            hints = ["in " + head.strip().rstrip(".").split(" in ", 1)[-1]] + \
                [t.removeprefix("hetrain: ") for t in tail if t.startswith("hetrain: ")] + hints
            kind, _, message = "\n".join(t for t in tail if not t.startswith("hetrain: ")).partition(": ")
            kind = kind.rsplit(".", 1)[-1]   # a module-qualified name, as traceback writes it
    first = []
    for text in message.splitlines():
        if not text.strip() or text.startswith(("Exception raised from", "frame #")):
            break
        first.append(text.strip())
    line = f"{kind}: {' '.join(first)}" if first else kind
    if len(line) > 300 and not isinstance(exc, HetrainError):   # hetrain's own are one line, its fix at the end
        cut = line[:296]
        line = (cut.rsplit(" ", 1)[0] if " " in cut[200:] else cut) + " ..."   # between words where one is near
    return line + "".join(f" ({hint})" for hint in hints)   # hetrain's notes on its likely cause, whole


def record_failure(message: str, *, secondary: bool = False, blame: int | None = None,
                   callstack: str = "") -> None:
    """Write this rank's failure to its elastic error file; the first record of a process stays."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    now = time.time()
    doc = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack, "timestamp": str(int(now)),
        RECORD_KEY: {"time": now, "secondary": secondary, "blame": blame}}}}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the record helps the launcher name the rank; the rank's own output still says why


def record_exception(exc: BaseException) -> None:
    """Record an exception that ends this rank (call it from the rank's excepthook)."""
    record_failure(one_line(exc), secondary=is_peer_loss(exc),
                   callstack="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def read_failure_record(error_file_data: Any) -> FailureRecord | None:
    """The record in an elastic error file's JSON (hetrain's, or torch's @record), or None."""
    if not isinstance(error_file_data, dict):
        return None
    message = error_file_data.get("message")
    if message == "<NONE>":  # torch's stand-in when the rank wrote no error file
        return None
    if isinstance(message, str) and message:
        return FailureRecord(message.strip().splitlines()[0], float(error_file_data.get("timestamp", 0) or 0))
    if not isinstance(message, dict) or not message.get("message"):
        return None
    extra = message.get("extraInfo") or {}
    ours = extra.get(RECORD_KEY) or {}
    text = str(message["message"]).strip().splitlines()[0]
    when = float(ours.get("time", extra.get("timestamp", 0)) or 0)
    return FailureRecord(text, when, bool(ours.get("secondary", False)), ours.get("blame"))
