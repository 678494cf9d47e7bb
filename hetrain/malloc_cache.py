"""glibc's allocator as hetrain runs CPU work: freed blocks kept in the process for reuse.

By default glibc returns each large freed block (a batch's activations, a few MB) to the kernel and
maps it again on the next step, so every training step pays for thousands of page faults on freshly
zeroed pages: on a CPU rank 3,000-20,000 faults and 10-40% of the step time were measured. With
blocks up to 32 MiB kept and reused, the same step takes a few dozen.

`hetrain launch` gives its workers this setting through the environment (`worker_env`), and
`hetrain profile` measures CPU steps under the same setting (`apply_here`), so that a profile times
the step a launched rank will run. A user who sets MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_
keeps their own choice in both.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

MALLOC_CACHE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
"""glibc's tunables, as environment variables read when a process starts."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameters (glibc's malloc.h)


def glibc() -> bool:
    """Linux with glibc, where these settings exist."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def user_chose() -> bool:
    """The user set one of the tunables: theirs is kept."""
    return any(k in os.environ for k in MALLOC_CACHE_ENV)


def worker_env() -> dict[str, str]:
    """The environment variables to add to a worker's environment (none off glibc or where the user chose)."""
    return dict(MALLOC_CACHE_ENV) if glibc() and not user_chose() else {}


def apply_here() -> bool:
    """Set the same thresholds in this running process (mallopt); True if they were set."""
    if not glibc() or user_chose():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(MALLOC_CACHE_ENV["MALLOC_MMAP_THRESHOLD_"]))) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, int(MALLOC_CACHE_ENV["MALLOC_TRIM_THRESHOLD_"])))
