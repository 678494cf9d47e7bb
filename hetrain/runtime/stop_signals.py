"""The signals a job takes as a request to save and stop: SIGTERM, and SIGUSR1 where nothing else handles it.

A scheduler may warn a job before it ends it: Slurm's `--signal=USR1@120` sends SIGUSR1 to every process of
the job two minutes before its time limit. SIGUSR1's default action ends a process at once, so a job that
does not take it loses every step since its last checkpoint. `hetrain launch`, each rank's Session that
checkpoints and the loader's workers take it as they take SIGTERM, unless the script has a handler of its
own for it (set before the session, or after it: the session then leaves SIGUSR1 to the script).
"""

from __future__ import annotations

import signal


def takes_usr1() -> bool:
    """Whether this process takes SIGUSR1 as SIGTERM: where it exists and nothing handles it yet."""
    return hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
