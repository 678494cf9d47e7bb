"""Files of a checkpoint: what may go in them, durable writes with checksums, safe reads.

A checkpoint file holds tensors, numbers, strings, bytes, None, torch dtypes/devices/sizes and
dicts, lists and tuples of these: exactly what `torch.load(weights_only=True)` accepts, so reading
a checkpoint never runs code from the file.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hetrain.checkpoint.errors import CheckpointError

_LEAF_TYPES = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)
_CHUNK = 1 << 22


def snapshot(obj: Any, *, copy: bool, where: str = "state") -> Any:
    """Check `obj` holds only checkpointable values and return it with every tensor on the CPU.

    copy=True gives tensors that no later in-place update can change (for background writes);
    copy=False copies only what is not already a compact CPU tensor. A tensor that appears twice
    (tied weights) stays one tensor.
    """
    return _snapshot(obj, copy, where, {})


def _snapshot(obj: Any, copy: bool, where: str, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _host_tensor(obj, copy, where)
        return memo[key]
    if isinstance(obj, _LEAF_TYPES):
        return obj
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise CheckpointError(
                    f"{where} has a key {k!r} of type {type(k).__name__}; checkpoint dict keys are "
                    f"str, int, float, bool or None: convert the key before saving"
                )
            out[k] = _snapshot(v, copy, f"{where}[{k!r}]", memo)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [_snapshot(v, copy, f"{where}[{i}]", memo) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds tensors, "
        f"numbers, strings, bytes, None and dicts/lists/tuples of them, so that loading never runs "
        f"code: convert it (torch.as_tensor(...), .tolist(), float(...), a state_dict()) before saving"
    )


def _host_tensor(t: torch.Tensor, copy: bool, where: str) -> torch.Tensor:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise CheckpointError(
            f"{where} is a {type(t).__qualname__} (a tensor subclass such as a DTensor); pass "
            f"sharded state in `sharded` (written through torch.distributed.checkpoint), not here"
        )
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu", copy=True)
    compact = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if copy or not compact:
        return t.clone()
    return t


class _HashingWriter:
    """A file wrapper that counts and hashes what passes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.nbytes = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.nbytes += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def write_torch_file(obj: Any, path: Path) -> tuple[int, str]:
    """torch.save `obj` to `path`, fsync it, and return (bytes, sha256 hex) of what was written."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return w.nbytes, w.sha.hexdigest()


def sha256_file(path: Path) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file, read in chunks."""
    sha, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            n += len(chunk)
    return n, sha.hexdigest()


def fsync_file(path: Path) -> None:
    """Flush a file already written by someone else (DCP) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def read_torch_file(path: Path) -> Any:
    """torch.load(weights_only=True) on the CPU; a file holding any other pickled object is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = f"a pickled object of class {found.group(1)}" if found else "a pickled object that is not plain data"
        raise CheckpointError(
            f"{path} holds {what}; hetrain loads only tensors, numbers, strings and containers of them "
            f"and never runs code from a checkpoint: re-save that state as plain data "
            f"(a state_dict() of tensors and numbers)"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}); the file is damaged: use an older checkpoint") from None
