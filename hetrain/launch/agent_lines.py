"""What the elastic agent logs, as `hetrain launch` shows it.

- Its warnings that the launcher's last line says better are left out: which rank failed and why, or
  that a signal stopped the job and what that means for its checkpoints. How the agent signals its
  workers on the way ("Received 2 death signal", "Sending process 1234 closing signal SIGINT") is
  neither.
- Its restarts, which it logs only at INFO (not shown by default), are said in one line each: without
  it the ranks' start-up lines simply came again below the failed rank's output.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

AGENT_LINES = ("failed (exitcode", "Sending process %s closing signal", "Received %s death signal")
AGENT = "torch.distributed.elastic.agent.server.api"          # the agent: its restarts, its signal line
WORKERS = "torch.distributed.elastic.multiprocessing.api"   # its workers: failed, closing signal
RESTARTING = "[%s] Worker group %s. "   # then "%s/%s attempts left; will restart worker group"
NODES_JOINING = "[%s] Detected %s new nodes"


def restart_line(record: logging.LogRecord) -> str | None:
    """The launcher's line for an agent's record that announces a restart, else None."""
    msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
    if msg.startswith(RESTARTING) and len(args) == 4:
        try:
            left, most = int(args[2]), int(args[3])
        except (TypeError, ValueError):   # another torch's record: the agent's own line is left as it is
            return None
        return (f"hetrain launch: the job failed on this node (its output is above); starting every rank again, "
                f"restart {most - left + 1} of {most} (--max-restarts)")
    if msg.startswith(NODES_JOINING) and len(args) == 3:
        return (f"hetrain launch: {args[1]} node(s) wait to join the job (one that restarted, or a new one); "
                "starting every rank again with them")
    return None


def leave_to_the_launcher() -> Callable[[], None]:
    """Drop the agent's AGENT_LINES from its logs and say its restarts; returns what puts the logs back."""
    agent, workers = logging.getLogger(AGENT), logging.getLogger(WORKERS)
    level, shown = agent.level, agent.getEffectiveLevel()   # what the user's LOGLEVEL shows, WARNING by default

    def workers_said(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(AGENT_LINES)

    def agent_said(record: logging.LogRecord) -> bool:
        line = restart_line(record)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return record.levelno >= shown and workers_said(record)

    agent.addFilter(agent_said)
    agent.setLevel(min(shown, logging.INFO))   # its restarts are INFO records
    workers.addFilter(workers_said)

    def undo() -> None:
        agent.removeFilter(agent_said)
        agent.setLevel(level)
        workers.removeFilter(workers_said)
    return undo
