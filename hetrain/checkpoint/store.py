"""The checkpoint directory: names, atomic commit by rename, and keeping the last K."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from hetrain.checkpoint.safe_io import fsync_dir

_STEP = re.compile(r"^step-(\d{6,})$")
TMP_PREFIX = ".tmp-step-"
_REPLACED_PREFIX = ".replaced-step-"


def step_name(step: int) -> str:
    """`step-000123`: sorts by name in step order up to a million steps, by number beyond."""
    return f"step-{step:06d}"


def tmp_dir(root: Path, step: int) -> Path:
    """Where the ranks write a checkpoint before it is complete."""
    return root / f"{TMP_PREFIX}{step:06d}"


def committed(root: Path) -> list[tuple[int, Path]]:
    """Directories named step-N (complete unless damaged since), newest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def commit(root: Path, tmp: Path, step: int) -> Path:
    """Rename a finished tmp directory to step-N (replacing an older one of that step), durably."""
    fsync_dir(tmp)
    final = root / step_name(step)
    replaced = None
    if final.exists():
        replaced = root / f"{_REPLACED_PREFIX}{step:06d}"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp, final)
    fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def prune(root: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints and any stale partial ones; the deleted."""
    removed = []
    if keep is not None:
        for _, path in committed(root)[keep:]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for entry in root.iterdir() if root.is_dir() else []:
        if entry.name.startswith((TMP_PREFIX, _REPLACED_PREFIX)) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
