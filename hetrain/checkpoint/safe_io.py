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

from hetrain.checkpoint.errors import CheckpointError, describe_os_error, os_read_fix

# exact types: a numpy.float64 is a float subclass, yet weights_only loading refuses it
_LEAF_TYPES = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size})
_KEY_TYPES = frozenset({str, int, float, bool, type(None)})
_CHUNK = 1 << 22


def snapshot(obj: Any, *, copy: bool, where: str = "state", buffers: dict[str, torch.Tensor] | None = None) -> Any:
    """Check `obj` holds only checkpointable values and return it with every tensor on the CPU.

    copy=True gives tensors that no later in-place update can change (for background writes);
    copy=False copies only what is not already a compact CPU tensor. A tensor that appears twice
    (tied weights) stays one tensor. `buffers` (kept by the caller between saves) holds the host
    copies for reuse, so a repeated save only copies memory instead of allocating it.
    """
    return _snapshot(obj, copy, where, {}, buffers)


def check_savable(obj: Any, where: str = "state") -> None:
    """Raise the CheckpointError `save()` would raise for `obj`, copying nothing: for state given long
    before its first save (session.add_state), refused when it is given."""
    _snapshot(obj, False, where, {}, None, check_only=True)


def _snapshot(obj: Any, copy: bool, where: str, memo: dict[int, torch.Tensor],
              buffers: dict[str, torch.Tensor] | None, check_only: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _plain_tensor(obj, where) if check_only else _host_tensor(obj, copy, where, buffers)
        return memo[key]
    if type(obj) in _LEAF_TYPES:
        return obj
    if type(obj) in (dict, OrderedDict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            if type(k) not in _KEY_TYPES:
                raise CheckpointError(
                    f"{where} has a key {k!r} of type {type(k).__name__}; checkpoint dict keys are "
                    f"str, int, float, bool or None: convert the key before saving"
                )
            out[k] = _snapshot(v, copy, f"{where}[{k!r}]", memo, buffers, check_only)
        return out
    if type(obj) in (list, tuple):
        items = [_snapshot(v, copy, f"{where}[{i}]", memo, buffers, check_only) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds tensors, "
        f"numbers, strings, bytes, None and dicts/lists/tuples of them, so that loading never runs "
        f"code: convert it (torch.as_tensor(...), .tolist(), float(...), a state_dict()) before saving"
    )


def _plain_tensor(t: torch.Tensor, where: str) -> torch.Tensor:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise CheckpointError(
            f"{where} is a {type(t).__qualname__} (a tensor subclass such as a DTensor); pass "
            f"sharded state in `sharded` (written through torch.distributed.checkpoint), not here"
        )
    return t


def _host_tensor(t: torch.Tensor, copy: bool, where: str, buffers: dict[str, torch.Tensor] | None) -> torch.Tensor:
    t = _plain_tensor(t, where).detach()
    compact = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if not copy and t.device.type == "cpu":
        return t if compact else t.clone()
    if buffers is None:
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
    buf = buffers.get(where)
    dense = t.is_contiguous() or compact
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or (dense and buf.stride() != t.stride()):
        pin = t.device.type == "cuda"
        buf = torch.empty_like(t, device="cpu", pin_memory=pin) if dense else torch.empty(
            t.shape, dtype=t.dtype, pin_memory=pin)
        buffers[where] = buf
    buf.copy_(t)
    return buf


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
    except PermissionError as e:   # no damage: another user's file
        raise CheckpointError(f"{path} cannot be read ({describe_os_error(e)}); {os_read_fix(e)}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}); the file is damaged: use an older checkpoint") from None
