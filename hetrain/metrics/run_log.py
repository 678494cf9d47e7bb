"""The run log: each rank appends one JSON line per step, checkpoint and restart to RUN_DIR/metrics/.

One file per rank (`rank-N.jsonl`), so ranks never write the same file; a restarted rank appends
to its file. Each line is handed to the operating system as it is written (one `write` call, about
1 us on a local disk), so a rank that raises, is stopped by SIGTERM, calls `os._exit` or is killed
with SIGKILL leaves every line it wrote on disk: the report of a failed run shows the steps it did.
Only a machine that goes down loses what the OS had not yet stored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from hetrain.errors import HetrainError
from hetrain.metrics.events import CheckpointRecord, StepRecord
from hetrain.vocabulary import Env

log = logging.getLogger("hetrain")

SUBDIR = "metrics"
BUFFER_BYTES = 1 << 16   # a line longer than this is written in pieces (a SIGKILL between them tears it)


def _flat(record: Any) -> dict[str, Any]:
    """A record's fields, shallow (dataclasses.asdict deep-copies: ten times slower on the step path)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _finite(value: Any) -> Any:
    """`value` with every inf and NaN float, at any depth, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / SUBDIR / f"rank-{rank}.jsonl"


def _ends_mid_line(path: Path) -> bool:
    """Whether the file at `path` ends without a newline (part of a line written)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


class RunLog:
    """Appends this rank's records as JSON lines (the owner writes the `start` line first)."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        path = log_path(run_dir, rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torn = _ends_mid_line(path)
            self._file = open(path, "a", encoding="utf-8", buffering=BUFFER_BYTES)
            if torn:   # a rank killed mid-write, or a full disk, left part of a line: this run's first starts anew
                self._file.write("\n")
        except OSError as e:
            raise HetrainError(f"cannot write the run log {str(path)!r} ({e.strerror}); "
                               f"set {Env.RUN_DIR} to a writable directory") from None
        self.path = path

    def write(self, line: dict[str, Any]) -> None:
        """Append one record and hand it to the OS at once (write-through: nothing waits in this process)."""
        if self._file.closed:   # stopped after a write failed: the training goes on without its log
            return
        record = {"time": time.time(), **line}
        try:
            text = json.dumps(record, allow_nan=False)
        except ValueError:   # a skipped step's inf or NaN loss: JSON has no such number, null stands for it
            text = json.dumps(_finite(record), allow_nan=False)
        try:
            self._file.write(text + "\n")
            self._file.flush()
        except OSError as e:   # a full disk, a quota, a filesystem gone: training outlives its log
            log.warning("the run log %s stops here (%s); training goes on, and hetrain report shows the steps "
                        "written before: free space or give --run-dir on another filesystem", self.path,
                        e.strerror or e)
            try:
                self._file.close()
            except OSError:   # what the buffer held cannot be written either
                pass

    def step(self, record: StepRecord, **extra: Any) -> None:
        self.write({"kind": "step", **_flat(record), "waiting_seconds": record.waiting_seconds, **extra})

    def checkpoint(self, record: CheckpointRecord) -> None:
        self.write({"kind": "checkpoint", **_flat(record)})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_lines(path: Path, on_skip: Callable[[], None] | None = None) -> Iterator[dict[str, Any]]:
    """The records (JSON objects) of one rank's log; a torn last line (a rank killed mid-write) and
    any line that is not an object (garbled, not UTF-8) are skipped, each calling `on_skip`."""
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                record = None
            if isinstance(record, dict):
                yield record
            elif on_skip is not None and line.strip():
                on_skip()


def find_logs(run_dir: str | Path) -> dict[int, Path]:
    """rank -> log file under RUN_DIR/metrics (or RUN_DIR itself when it is that folder)."""
    root = Path(run_dir)
    folder = root / SUBDIR if (root / SUBDIR).is_dir() else root
    logs = {}
    for p in folder.glob("rank-*.jsonl"):
        try:
            logs[int(p.stem.split("-", 1)[1])] = p
        except ValueError:
            continue
    return dict(sorted(logs.items()))
