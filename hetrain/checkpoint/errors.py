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


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_DENIED = {errno.EACCES, errno.EPERM}


def os_error_fix(e: BaseException) -> str:
    """The likely fix for an OS error met while writing a checkpoint, by its errno (never a guess at free space).

    Only a full disk or quota (ENOSPC, EDQUOT) speaks of free space; a vanished file points at another
    writer in the same directory, a read-only filesystem or a refused permission says so.
    """
    code = getattr(e, "errno", None)
    if code in _FULL:
        return "the filesystem is full: free space or pass a --checkpoint-dir on a larger filesystem"
    if code == errno.EROFS:
        return "the filesystem is read-only: pass a writable --checkpoint-dir"
    if code in _DENIED:
        return "this user may not write there: fix the directory's permissions or pass another --checkpoint-dir"
    if code in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
        return ("a file of the save appeared or vanished while it was written: only one job may use a checkpoint "
                "directory, and every rank must see the same one")
    if code in (errno.ENOTDIR, errno.EISDIR):
        return "a path inside the checkpoint directory is not what hetrain wrote: pass a directory only hetrain writes"
    return "check that the checkpoint directory is writable and that every rank sees the same one"


def describe_os_error(e: BaseException) -> str:
    """`strerror` of an OS error (its class and text for anything else), for a one-line message."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}"
