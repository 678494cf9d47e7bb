"""Which rank failed first, from what torch's elastic agent hands back (ChildFailedError.failures).

The agent stamps each failure with the whole second it noticed it, or with the time in the rank's
error file. Two ranks that end in the same second tie, and a rank that raised but was slow to exit
(its interpreter still tearing down) is noticed after the peers its death disconnected. So the
first failure is chosen by cause before time: a rank's own record (`hetrain.runtime.watchdog`,
written when the exception happened, to the microsecond) says whether it is a cause or only a
peer's echo; a rank without a record that the agent itself stopped (SIGTERM) is an echo too.
Among causes, times are compared to the whole second, the agent's resolution: in a tie, a rank's own
record goes before a bare exit code (a rank whose peer reported a stall and left can die by a signal
in the same second, and the agent's stamp of that second would otherwise read as the earlier time).
"""

from __future__ import annotations

import signal
from typing import Any

from hetrain.runtime.failure_record import FailureRecord, read_failure_record

STOPPED_BY_AGENT = (-int(signal.SIGTERM), 128 + int(signal.SIGTERM))
"""Exit codes of a rank the agent stopped after another failed (killed, or saved and exited 143)."""


def stopped_on_sigterm(failures: dict[int, Any]) -> bool:
    """Every rank saved and stopped on a SIGTERM it received (exit 143), but for ranks the agent itself
    then stopped on their way out (SIGTERM): a scheduler that signals the ranks before their launcher."""
    codes = [f.exitcode for f in failures.values()]
    return 128 + int(signal.SIGTERM) in codes and all(c in STOPPED_BY_AGENT for c in codes)


def _record(failure: Any) -> FailureRecord | None:
    return read_failure_record(getattr(failure, "error_file_data", None))


def killed_from_outside(failures: dict[int, Any]) -> bool:
    """Every failed rank was killed by a SIGTERM and wrote no record: the agent sends SIGTERM only after a failure,
    and none came first, so the signal came from outside the job (a user's kill, a scheduler)."""
    return all(f.exitcode == -int(signal.SIGTERM) and _record(f) is None for f in failures.values())


def is_cause(failure: Any) -> bool:
    """Whether this failure may be where the job's trouble began, not a consequence of another."""
    record = _record(failure)
    if record is not None:
        return not record.secondary
    return failure.exitcode not in STOPPED_BY_AGENT


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """(global rank, ProcessFailure) of the rank that failed first: causes before echoes, then by time."""
    def order(item: tuple[int, Any]) -> tuple[bool, int, bool, float, int]:
        rank, failure = item
        record = _record(failure)
        recorded = record is not None and bool(record.time)
        when = record.time if recorded else float(failure.timestamp)
        return (not is_cause(failure), int(when), not recorded, when, rank)

    return min(failures.items(), key=order)


def how_it_ended(exitcode: int) -> str:
    """"exited with code 1", or "was killed by SIGKILL" for a negative code."""
    if exitcode == -signal.SIGABRT:   # no Python error to report: say where such aborts come from
        return ("was killed by SIGABRT (an abort in C++; under gloo, ranks calling different collectives: a "
                "collective of the script's own that one rank alone calls (inside `if rank == 0:`) or whose size "
                "follows the rank's share (dist.all_gather of batch rows: session.gather_rows), one under "
                "micro-batches, or a branch one rank alone takes inside an FSDP2 block; docs/porting.md)")
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def killed_hint(exitcode: int) -> str:
    """What a rank's death by SIGKILL most often means, to follow the sentence that says it; else ''."""
    if exitcode != -signal.SIGKILL:
        return ""
    return ("; a SIGKILL no one sent is most often the kernel's, when the host runs out of memory (`dmesg` names "
            "the process it killed)")


def describe(rank: int, failure: Any) -> str:
    """One sentence: the rank, how it ended, and what it recorded (a stall report names its culprit)."""
    record = _record(failure)
    ended = how_it_ended(failure.exitcode)
    if record is not None and record.blame is not None:
        return f"{record.message}; rank {rank} reported it and {ended}"
    return f"rank {rank} {ended}" + (f": {record.message}" if record is not None else "")
