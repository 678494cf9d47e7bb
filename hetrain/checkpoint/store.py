"""The checkpoint directory: checked at start, atomic commit by rename, damaged ones set aside, the last K kept."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from hetrain.checkpoint.errors import describe_os_error, os_error_fix
from hetrain.checkpoint.manifest import check_layout, read_manifest, verify
from hetrain.checkpoint.safe_io import fsync_dir
from hetrain.userfiles import dangling_link

_STEP = re.compile(r"^step-(\d{6,})$")
TMP_PREFIX = ".tmp-step-"
DAMAGED_PREFIX = "damaged-"
_REPLACED_PREFIX = ".replaced-step-"
_PRUNED_PREFIX = ".pruned-step-"


def step_name(step: int) -> str:
    """`step-000123`: sorts by name in step order up to a million steps, by number beyond."""
    return f"step-{step:06d}"


def step_of(path: Path) -> int | None:
    """The step a `step-N` directory name says (None for any other name)."""
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else None


def tmp_dir(root: Path, step: int) -> Path:
    """Where the ranks write a checkpoint before it is complete."""
    return root / f"{TMP_PREFIX}{step:06d}"


def check_directory(root: Path, probe: str) -> str | None:
    """None when `root` is (or can be made) a directory this process can write; else a one-line reason and fix.

    Checked when a job starts, so that a wrong --checkpoint-dir fails before any training, not at the
    first save. `probe` is a file name unique to the caller, written and removed.
    """
    if root.exists() and not root.is_dir():
        return (f"checkpoint directory {root} exists and is not a directory; pass a directory path as "
                f"--checkpoint-dir (checkpoint_dir=)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        link = dangling_link(root)
        if link is not None:   # a link to a volume not mounted yet, say: its target is not made here
            return (f"checkpoint directory {root} cannot be created: {link} is a link to {os.readlink(link)}, "
                    "which does not exist; create the link's target (mount its volume) or pass another directory "
                    "as --checkpoint-dir (checkpoint_dir=)")
        return (f"checkpoint directory {root} cannot be created: a part of its path is a file; pass a directory "
                f"path as --checkpoint-dir (checkpoint_dir=)")
    except OSError as e:
        return f"checkpoint directory {root} cannot be created ({describe_os_error(e)}); {os_error_fix(e)}"
    path = root / probe
    try:
        with open(path, "xb") as f:
            f.write(b"hetrain")
        path.unlink()
    except OSError as e:
        return f"checkpoint directory {root} is not writable ({describe_os_error(e)}); {os_error_fix(e)}"
    return None


def committed(root: Path) -> list[tuple[int, Path]]:
    """Directories named step-N (complete unless damaged since), newest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found, reverse=True)


def damaged(root: Path) -> list[Path]:
    """Checkpoints set aside as damaged (`damaged-step-N`), by name."""
    return sorted(p for p in root.glob(f"{DAMAGED_PREFIX}step-*") if p.is_dir()) if root.is_dir() else []


def _unused(path: Path, name: str) -> Path:
    """`name` beside `path`, or `name-2`, `name-3`... when taken."""
    target, n = path.with_name(name), 2
    while target.exists():
        target, n = path.with_name(f"{name}-{n}"), n + 1
    return target


def set_aside(path: Path) -> Path:
    """Rename a damaged `step-N` to `damaged-step-N` (`-2`, `-3`... when taken), so it is kept for inspection
    but never loaded or counted among the kept checkpoints."""
    target = _unused(path, DAMAGED_PREFIX + path.name)
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def commit(root: Path, tmp: Path, step: int) -> Path:
    """Rename a finished tmp directory to step-N (replacing an older one of that step), durably.

    Replacing takes two renames (step-N to .replaced-step-N, then .tmp-step-N to step-N): a crash between
    them leaves no step-N, which `restore_replaced` puts back before the next look or prune.
    """
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


def restore_replaced(root: Path) -> list[str]:
    """Put back each step-N that a crash took away while a save of the same step replaced it: the new save
    (`.tmp-step-N`) where its manifest and files verify, else the old one (`.replaced-step-N`). One line per
    step put back, saying which."""
    restored = []
    for entry in sorted(root.glob(f"{_REPLACED_PREFIX}*")) if root.is_dir() else []:
        suffix = entry.name[len(_REPLACED_PREFIX):]
        final = root / f"step-{suffix}"
        if not (suffix.isdigit() and entry.is_dir()) or final.exists() or final.is_symlink():
            continue   # (a step-N beside it: the replace finished, and prune deletes the old one)
        tmp = root / f"{TMP_PREFIX}{suffix}"
        if not tmp.is_dir():   # not the commit's window (its new save beside it): an old copy left behind after
            continue           # its step-N was pruned, perhaps half deleted, never put back as a checkpoint
        if _verifies(tmp, int(suffix)):
            os.rename(tmp, final)
            restored.append(f"{final.name} was being replaced when the job stopped; its new save is complete and "
                            f"is {final.name} now")
        else:
            os.rename(entry, final)
            restored.append(f"{final.name} was being replaced when the job stopped, before its new save was "
                            f"complete; the previous {final.name} is back")
        fsync_dir(root)
    return restored


def _verifies(path: Path, step: int) -> bool:
    if not path.is_dir():
        return False
    try:
        manifest = read_manifest(path)
    except ValueError:
        return False
    return check_layout(path, manifest, step) is None and verify(path, manifest) is None


def prune(root: Path, keep: int | None, newest: Path | None = None) -> tuple[list[Path], dict[str, str]]:
    """Delete all but `keep` committed checkpoints and any stale partial ones: (the deleted, those that
    could not be, each with why: path -> reason).

    `newest` (the checkpoint just committed) is always among those kept, with the `keep - 1` highest
    steps besides it: a checkpoint left from an earlier run with a higher step never outranks it.
    A checkpoint is renamed `.pruned-step-N` before it is deleted, so one whose files cannot all be
    deleted (a file another user owns, a busy file on NFS) never looks complete; a later prune tries again.
    """
    removed: list[Path] = []
    failed: dict[str, str] = {}   # path -> why, the first reason only (a retry below may fail another way)
    restore_replaced(root)   # a checkpoint a crash left half-replaced is counted, not deleted as stale
    if keep is not None:
        others = [path for _, path in committed(root) if newest is None or path != newest]
        for path in others[keep - (newest is not None):]:
            # a name of its own: one of this step may be left undeletable before (a fresh start saved it again)
            aside = _unused(path, _PRUNED_PREFIX + path.name.removeprefix("step-"))
            try:
                os.rename(path, aside)
            except OSError as e:
                failed.setdefault(str(path), describe_os_error(e))
                continue
            if _remove(aside, failed):
                removed.append(path)
    for entry in root.iterdir() if root.is_dir() else []:
        if entry.name.startswith((TMP_PREFIX, _REPLACED_PREFIX, _PRUNED_PREFIX)) and entry.is_dir() \
                and _remove(entry, failed):
            removed.append(entry)
    return removed, failed


def _remove(path: Path, failed: dict[str, str]) -> bool:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        failed.setdefault(str(path), describe_os_error(e))
        return False
    return True
