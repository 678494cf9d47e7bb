"""Reading and writing the files a user names (cluster, plan, profile, topology, outputs).

Each problem becomes one HetrainError line that names the file, the reason and the fix, before
any work is done: a missing or unreadable file, a binary file, a file too large to be what it
claims, an output directory that does not exist or cannot be written.
"""

from __future__ import annotations

import os
from pathlib import Path

from hetrain.errors import HetrainError

MAX_TEXT_BYTES = 8 * 2**20
"""Largest input text file hetrain reads (8 MiB): a cluster of 65,536 devices fits in far less."""


def read_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of `path`, or a one-line error naming `what` the file was meant to be."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if p.is_dir():
            raise HetrainError(f"{what} {str(p)!r} is a directory; fix: give the path of a file")
        with open(p, "rb") as f:   # at most the limit and a byte: a device or a pipe's size is 0 (/dev/zero never ends)
            data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:
            said = f"{size / 2**20:.1f} MiB" if size > max_bytes else f"over {max_bytes / 2**20:g} MiB"
            raise HetrainError(f"{what} {str(p)!r} is {said}; hetrain reads {what}s of at most "
                               f"{max_bytes / 2**20:g} MiB; fix: check that this is the right file")
    except FileNotFoundError:
        raise HetrainError(f"{what} {str(p)!r} not found; fix: check the path") from None
    except OSError as e:
        raise HetrainError(f"{what} {str(p)!r} cannot be read ({e.strerror}); fix: check the file and its permissions") from None
    if b"\x00" in data:
        raise HetrainError(f"{what} {str(p)!r} is a binary file, not text; fix: give the {what} itself")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HetrainError(
            f"{what} {str(p)!r} is not UTF-8 text (byte {e.start}); fix: give the {what} itself"
        ) from None


def check_writable_file(path: str | os.PathLike, flag: str) -> Path:
    """`path` can be written as a file: its directory exists and is writable, and it is no directory."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise HetrainError(f"{flag} {str(p)!r} is a directory; fix: give a file name, e.g. {p / 'out'}")
    if not parent.is_dir():
        raise HetrainError(f"{flag} {str(p)!r}: directory {str(parent)!r} does not exist; fix: create it or choose another path")
    try:  # os.access says yes to root even on a read-only file system: try it
        if p.exists():
            with open(p, "r+b"):
                pass
        else:
            with open(p, "xb"):
                pass
            p.unlink()
    except OSError as e:
        raise HetrainError(f"{flag} {str(p)!r} cannot be written ({e.strerror}); fix: choose a writable path") from None
    return p


def ensure_directory(path: str | os.PathLike, flag: str) -> Path:
    """`path` as a writable directory, created if missing; a one-line error where it cannot be."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise HetrainError(f"{flag} {str(p)!r} is a file, not a directory; fix: give a directory path")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        link = dangling_link(p)
        if link is not None:
            raise HetrainError(f"{flag} {str(p)!r} cannot be created: {link} is a link to {os.readlink(link)}, which "
                               "does not exist; fix: create the link's target (mount its volume) or give another "
                               "directory") from None
        raise HetrainError(f"{flag} {str(p)!r} cannot be created: a part of its path is a file; fix: give a "
                           "directory path") from None
    except OSError as e:
        raise HetrainError(f"{flag} {str(p)!r} cannot be created ({e.strerror}); fix: choose a writable path") from None
    probe = p / f".hetrain-write-test-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise HetrainError(f"{flag} {str(p)!r} cannot be written ({e.strerror}); fix: choose a writable directory") from None
    return p


def dangling_link(path: Path) -> Path | None:
    """`path` or the first of its parents that is a link to nothing (a volume not mounted yet, say), if any:
    a directory under it cannot be made, and its target is not hetrain's to make."""
    return next((q for q in (path, *path.parents) if q.is_symlink() and not q.exists()), None)


def is_binary(path: str | os.PathLike, head_bytes: int = 1 << 16) -> bool:
    """Whether the file's first `head_bytes` hold a NUL byte (an executable, an archive), which no
    source file does; an unreadable file is left for its reader to report."""
    try:
        with open(path, "rb") as f:
            return b"\x00" in f.read(head_bytes)
    except OSError:
        return False
