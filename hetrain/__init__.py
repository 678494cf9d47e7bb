"""hetrain: train one PyTorch model across GPUs that are not alike, at the sum of their speeds.

What a user imports:

    from hetrain import Session, Plan, plan_job, profile, HetrainError
"""

from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING

from hetrain.errors import HetrainError
from hetrain.vocabulary import Env as _Env

if _os.environ.get(_Env.LAUNCH_ID):   # a rank of `hetrain launch`: Ctrl-C before its Session is a line too
    from hetrain.runtime.interrupt_hook import say_interrupts_in_a_line

    say_interrupts_in_a_line()

if TYPE_CHECKING:   # what a type checker sees of the names imported on first use below
    from hetrain.planning.plan import Plan
    from hetrain.planning.planner import plan_job
    from hetrain.runtime.session import Session
    from hetrain.workload.profile import profile

__version__ = "0.1.0"

__all__ = ["HetrainError", "Plan", "Session", "__version__", "plan_job", "profile"]

# Imported on first use, so `hetrain --help` does not pay for torch.distributed.
_LAZY = {
    "Session": ("hetrain.runtime.session", "Session"),
    "Plan": ("hetrain.planning.plan", "Plan"),
    "plan_job": ("hetrain.planning.planner", "plan_job"),
    "profile": ("hetrain.workload.profile", "profile"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hetrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
