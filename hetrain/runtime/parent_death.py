"""A worker gets SIGTERM when the process that started it (the `hetrain launch` process, where torch's
elastic agent runs) dies, even by SIGKILL, instead of training on as an orphan. Linux:
prctl(PR_SET_PDEATHSIG); elsewhere a thread that watches the parent pid."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value); False where it is not available or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM, poll_s: float = 1.0, *, use_prctl: bool = True) -> None:
    """Have the kernel send `sig` to this process when its parent dies (SIGTERM: a Session saves).

    The parent is whoever started this process: under `hetrain launch` or torchrun, the launcher
    process itself (torch's elastic agent runs inside it and starts the workers). Without prctl,
    a daemon thread checks the parent pid every `poll_s` seconds. prctl's signal comes when the
    parent's thread that started this process ends; torch's agent starts workers from its main thread.
    """
    parent = os.getppid()
    if use_prctl and prctl(_PR_SET_PDEATHSIG, int(sig)):
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="hetrain-parent-watch", daemon=True).start()
