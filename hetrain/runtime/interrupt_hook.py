"""A launched rank's Ctrl-C before its Session began, in one line as after (`hetrain.runtime.ending_lines`).

A script under `hetrain launch` spends its first seconds or minutes before `hetrain.Session()`: loading a
model's weights, building a dataset. Ctrl-C there printed each rank's KeyboardInterrupt traceback above
the launcher's line, as it did everywhere before the Session's own hook said it in a line. `import
hetrain` under the launcher installs this hook, which says that one interruption as the Session's hook
does and leaves every other error to the hook before it; the Session's hook, installed later, wraps it.
Nothing here imports torch until a rank is interrupted.
"""

from __future__ import annotations

import sys
from types import TracebackType

INTERRUPT_HOOK = "_hetrain_interrupts"
"""The attribute that marks this hook (installed once)."""


def say_interrupts_in_a_line() -> None:
    """Install the hook, where `import hetrain` runs in a rank of `hetrain launch` (not at a prompt)."""
    previous = sys.excepthook
    if getattr(previous, INTERRUPT_HOOK, False) or getattr(previous, "_hetrain", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, KeyboardInterrupt) and not sys.flags.interactive:
            try:
                from hetrain.runtime.ending_lines import ending_line

                line = ending_line(value, tb)   # the Session's hook's line for it
            except Exception:   # (interrupted inside torch's own import, say): the traceback, as before
                line = None
            if line is not None:
                sys.__stderr__.write(line + "\n")
                sys.__stderr__.flush()
                return
        previous(kind, value, tb)

    setattr(hook, INTERRUPT_HOOK, True)
    sys.excepthook = hook
