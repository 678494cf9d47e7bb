"""The one error the checkpoint service raises, and what an OS error on a checkpoint path means."""

from __future__ import annotations

import errno

from hetrain.errors import HetrainError


# The way on after a refused resume: a fresh run, given the checkpoint's trained weights.
START_FROM_WEIGHTS = ("start in an empty checkpoint directory, loading this checkpoint's model weights first "
                      "(load_state_dict(..., strict=False) for a changed model; docs/checkpoints.md, 'The weights in "
                      "plain PyTorch')")


class CheckpointError(HetrainError):
    """A checkpoint cannot be written or read: the message names the path, the reason and the fix."""


_QUOTA = getattr(errno, "EDQUOT", errno.ENOSPC)
_DENIED = {errno.EACCES, errno.EPERM}


def os_error_fix(e: BaseException, what: str = "checkpoint directory", flag: str = "--checkpoint-dir") -> str:
    """The likely fix for an OS error met while writing a checkpoint, by its errno (never a guess at free space).

    Only a full disk or quota (ENOSPC, EDQUOT) speaks of free space, and a file too large (EFBIG) of the
    limit on a file's size; a vanished file points at another writer in the same directory, a read-only
    filesystem or a refused permission says so. `what` and `flag` name the directory (a run directory's
    lease: "run directory", "--run-dir").
    """
    code = getattr(e, "errno", None)
    if code == errno.ENOSPC:
        return f"the filesystem is full: free space or pass a {flag} on a larger filesystem"
    if code == _QUOTA:
        return f"this user's disk quota is full: free space under it, raise the quota or pass a {flag} elsewhere"
    if code == errno.EFBIG:
        return (f"a file is larger than the filesystem or this process's file-size limit (ulimit -f) allows: raise "
                f"the limit or pass a {flag} on a filesystem that holds larger files")
    if code == errno.EROFS:
        return f"the filesystem is read-only: pass a writable {flag}"
    if code in _DENIED:
        return f"this user may not write there: fix the directory's permissions or pass another {flag}"
    if code in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
        return (f"a file appeared or vanished while it was written: only one job may use a {what}, and every "
                "rank must see the same one")
    if code in (errno.ENOTDIR, errno.EISDIR):
        return f"a path inside the {what} is not what hetrain wrote: pass a directory only hetrain writes"
    return f"check that the {what} is writable and that every rank sees the same one"


def os_read_fix(e: BaseException) -> str:
    """The likely fix for an OS error met while reading a checkpoint (a refused permission is no damage)."""
    if getattr(e, "errno", None) in _DENIED:
        return ("this user may not read it: fix its permissions (files another user wrote) or pass another "
                "--checkpoint-dir")
    return "check the file and the filesystem it lies on, or pass another --checkpoint-dir"


def os_error_in(e: BaseException | None) -> OSError | None:
    """The OS error behind `e` (itself, or the first in its chain of causes: torch wraps some in RuntimeError)."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e


def describe_os_error(e: BaseException) -> str:
    """`strerror` of an OS error (its class and text for anything else), for a one-line message."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"
