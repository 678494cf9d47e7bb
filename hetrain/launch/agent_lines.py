"""What the elastic agent logs, as `hetrain launch` shows it.

- Its warnings that the launcher's last line says better are left out: which rank failed and why, or
  that a signal stopped the job and what that means for its checkpoints. How the agent signals its
  workers on the way ("Received 2 death signal", "Sending process 1234 closing signal SIGINT") is
  neither.
- Its restarts, which it logs only at INFO (not shown by default), are said in one line each: without
  it the ranks' start-up lines simply came again below the failed rank's output. The line names the rank
  that failed and how (`who_failed`), from the records the ranks left in the failed attempt's error files
  and from the failure the agent reported first; a rank killed by the kernel for memory left no output
  above to read.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
from collections.abc import Callable

from hetrain.launch.attempt_records import attempt_records
from hetrain.launch.failures import STOPPED_BY_AGENT, how_it_ended, killed_hint
from hetrain.runtime.failure_record import FailureRecord
from hetrain.runtime.watchdog import STALL_EXIT

AGENT_LINES = ("failed (exitcode", "Sending process %s closing signal", "Received %s death signal")
AGENT = "torch.distributed.elastic.agent.server.api"          # the agent: its restarts, its signal line
WORKERS = "torch.distributed.elastic.multiprocessing.api"   # its workers: failed, closing signal
RESTARTING = "[%s] Worker group %s. "   # then "%s/%s attempts left; will restart worker group"
NODES_JOINING = "[%s] Detected %s new nodes"
FAILED = "failed (exitcode: %s) local_rank: %s"   # then " (pid: %s) of binary: %s": the first failure it saw
ECHOES = (1, 2, STALL_EXIT, *STOPPED_BY_AGENT)
"""Exit codes a rank that only lost a peer, or reported a peer's stall, also ends with: a Python error (2 where a
launched rank with peers exits at once), the progress watch's report, the agent's SIGTERM."""


def failed_rank(record: logging.LogRecord) -> tuple[int, int] | None:
    """(exit code, local rank) of the failure a workers' record reports, else None."""
    args = record.args if isinstance(record.args, tuple) else ()
    if not str(record.msg).startswith(FAILED) or len(args) < 2:
        return None
    try:
        return int(args[0]), int(args[1])
    except (TypeError, ValueError):
        return None


def who_failed(failed: tuple[int, int] | None, records: dict[int, FailureRecord | None], one_node: bool) -> str:
    """Who failed, as a restart's line says it: the failure the agent saw first, where no peer's echo ends so (a
    signal, the script's own exit code: never a peer's loss), else the rank whose record is a cause and came first
    (an error of its own, or a stall it reported), else, on one node, the one rank that left no record while every
    other only lost its connection, or, on several, another node where every rank here only lost its peers; else
    this node. `failed`: (exit code, local rank) as the agent reported it (`failed_rank`); `records`: each local
    rank's record in the failed attempt (`attempt_records`)."""
    def rank(local: int) -> str:
        return f"rank {local}" if one_node else f"local rank {local} of this node"

    if failed is not None and failed[0] not in ECHOES:
        code, local = failed
        return f"{rank(local)} {how_it_ended(code)}" + (" (its output is above)" if code > 0 else killed_hint(code))
    causes = sorted((r.time, local, r) for local, r in records.items() if r is not None and not r.secondary)
    if causes:
        _, local, record = causes[0]
        if record.blame is not None:   # a stall report, which names the stalled rank (itself, where it found it)
            by = "" if one_node and record.blame == local else f"; {rank(local)} reported it"
            return f"{record.message}{by} (its output is above)"
        return f"{rank(local)} failed: {record.message} (its output is above)"
    silent = [local for local, r in records.items() if r is None]
    if one_node and len(records) > 1 and len(silent) == 1:   # every other record is an echo (no cause above)
        return (f"rank {silent[0]} ended with no error of its own, and every other rank only lost its connection to "
                f"it (a signal, or an exit of the script's own){killed_hint(-int(signal.SIGKILL))}")
    if not one_node and records and all(r is not None and r.secondary for r in records.values()):
        return "every rank on this node only lost its peers: the failure began on another node, whose output says which"
    return "the job failed on this node (its output is above)"


def restart_line(record: logging.LogRecord, failed: tuple[int, int] | None = None,
                 records: dict[int, FailureRecord | None] | None = None, one_node: bool = True) -> str | None:
    """The launcher's line for an agent's record that announces a restart, else None; `failed` and `records`
    tell who failed (`who_failed`)."""
    msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
    if msg.startswith(RESTARTING) and len(args) == 4:
        try:
            left, most = int(args[2]), int(args[3])
        except (TypeError, ValueError):   # another torch's record: the agent's own line is left as it is
            return None
        return (f"hetrain launch: {who_failed(failed, records or {}, one_node)}; starting every rank again, "
                f"restart {most - left + 1} of {most} (--max-restarts)")
    if msg.startswith(NODES_JOINING) and len(args) == 3:
        return (f"hetrain launch: {args[1]} node(s) wait to join the job (one that restarted, or a new one); "
                "starting every rank again with them")
    return None


def leave_to_the_launcher(one_node: bool = True, log_dir: str | None = None,
                          remove: bool = False) -> Callable[[], None]:
    """Drop the agent's AGENT_LINES from its logs and say its restarts, naming who failed from the records
    under the agent's `log_dir`; returns what puts the logs back (and removes `log_dir` where `remove`)."""
    agent, workers = logging.getLogger(AGENT), logging.getLogger(WORKERS)
    level, shown = agent.level, agent.getEffectiveLevel()   # what the user's LOGLEVEL shows, WARNING by default
    last_failure: list[tuple[int, int] | None] = [None]

    def not_said_better(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(AGENT_LINES)

    def workers_said(record: logging.LogRecord) -> bool:
        failed = failed_rank(record)
        if failed is not None:
            last_failure[0] = failed
        return not_said_better(record)

    def agent_said(record: logging.LogRecord) -> bool:
        restarting = str(record.msg).startswith(RESTARTING)   # (the records are read for a restart only)
        line = restart_line(record, last_failure[0], attempt_records(log_dir) if restarting else {}, one_node)
        if line is not None:
            last_failure[0] = None
            print(line, file=sys.stderr, flush=True)
        return record.levelno >= shown and not_said_better(record)

    agent.addFilter(agent_said)
    agent.setLevel(min(shown, logging.INFO))   # its restarts are INFO records
    workers.addFilter(workers_said)

    def undo() -> None:
        agent.removeFilter(agent_said)
        agent.setLevel(level)
        workers.removeFilter(workers_said)
        if remove and log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    return undo
