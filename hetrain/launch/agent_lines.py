"""The elastic agent's warnings that the launcher's last line says better: which rank failed and why, or that
a signal stopped the job and what that means for its checkpoints. How the agent signals its workers on the
way ("Received 2 death signal", "Sending process 1234 closing signal SIGINT") is neither."""

from __future__ import annotations

import logging
from collections.abc import Callable

AGENT_LINES = ("failed (exitcode", "Sending process %s closing signal", "Received %s death signal")
AGENT_LOGS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def _not_said_twice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(AGENT_LINES)


def leave_to_the_launcher() -> Callable[[], None]:
    """Drop the agent's AGENT_LINES from its logs; returns what puts them back."""
    logs = [logging.getLogger(name) for name in AGENT_LOGS]
    for log in logs:
        log.addFilter(_not_said_twice)

    def undo() -> None:
        for log in logs:
            log.removeFilter(_not_said_twice)
    return undo
