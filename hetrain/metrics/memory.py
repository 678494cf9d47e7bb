"""A rank's memory, read when Prometheus scrapes: CUDA's caching allocator, or the process's RSS on CPU."""

from __future__ import annotations

import os
import resource
import sys

import torch


def cuda_memory(device: torch.device) -> dict[str, float]:
    """kind -> bytes from torch's allocator for `device`."""
    return {
        "allocated": float(torch.cuda.memory_allocated(device)),
        "reserved": float(torch.cuda.memory_reserved(device)),
        "peak_allocated": float(torch.cuda.max_memory_allocated(device)),
        "peak_reserved": float(torch.cuda.max_memory_reserved(device)),
    }


def process_memory() -> dict[str, float]:
    """kind -> bytes of this process: resident set now ('rss', Linux) and its peak ('peak_rss')."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            out["rss"] = float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = float(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB
    # Linux updates the peak lazily (from its per-thread counters), so it can trail the current
    # resident set by a few pages: a peak is never below what is resident now
    out["peak_rss"] = max(peak, out.get("rss", 0.0))
    return out


def rank_memory(device: torch.device) -> dict[str, float]:
    """The memory figures that fit this rank's device."""
    return cuda_memory(device) if device.type == "cuda" else process_memory()
