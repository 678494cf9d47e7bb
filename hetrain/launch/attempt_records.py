"""The failure records of a job's newest attempt, read from the elastic agent's log folder.

The agent gives each worker an error file, `<log dir>/<run id>_<suffix>/attempt_<n>/<local rank>/error.json`,
in which a rank of a hetrain.Session records why it ended (`hetrain.runtime.failure_record`): its own error,
or only a peer's lost connection. The agent hands these back to the launcher only when the job ends; at a
restart the launcher reads them here, from the attempt that just failed (the newest: the next one's folder
is made after the agent logs its restart).
"""

from __future__ import annotations

import json
from pathlib import Path

from hetrain.runtime.failure_record import FailureRecord, read_failure_record


def newest_attempt(log_dir: str | Path) -> Path | None:
    """The folder of the attempt the agent started last under `log_dir`, or None where there is none."""
    attempts = [p for p in Path(log_dir).glob("*/attempt_*") if p.is_dir()]
    return max(attempts, key=lambda p: p.stat().st_mtime_ns) if attempts else None


def attempt_records(log_dir: str | Path | None) -> dict[int, FailureRecord | None]:
    """Local rank -> its record in the newest attempt (None for a rank that wrote none); {} without a folder."""
    records: dict[int, FailureRecord | None] = {}
    try:
        attempt = newest_attempt(log_dir) if log_dir else None
        ranks = [d for d in attempt.iterdir() if d.name.isdigit()] if attempt is not None else []
    except OSError:   # the folder removed or unreadable: the line names no rank, and the job goes on
        return records
    for rank_dir in ranks:
        try:
            records[int(rank_dir.name)] = read_failure_record(json.loads((rank_dir / "error.json").read_text()))
        except (OSError, ValueError):   # no file (a rank killed, or still at work), or one being written
            records[int(rank_dir.name)] = None
    return records
