"""What a hetrain process does at exit, while the interpreter is still whole. Imports no torch, so
the CLI can register it before a verb loads anything."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable

_registered: set[Callable[[], None]] = set()


def once_at_exit(fn: Callable[[], None]) -> None:
    """Register `fn` to run at exit, once per process however often this is called."""
    if fn not in _registered:
        atexit.register(fn)
        _registered.add(fn)


def collect_then_freeze() -> None:
    """Collect unreachable objects, then freeze what is left (`gc.freeze`): the interpreter's teardown
    does not walk torch's heap again (about 0.7 s of a process that imported torch and dynamo here)."""
    gc.collect()
    gc.freeze()
