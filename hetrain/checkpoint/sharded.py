"""Sharded state (ZeRO / FSDP2 / DTensor) through torch.distributed.checkpoint, read safely.

DCP itself reads its `.metadata` with `pickle.load` and non-tensor values with
`torch.load(weights_only=False)`. hetrain configures DCP with a reader whose unpickler admits only
the classes DCP's `Metadata` is built of (plain dataclasses and an enum, whose construction does
nothing else) and a planner that reads values with `weights_only=True`, so loading a checkpoint
never runs code from it and constructs nothing with side effects.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from hetrain.checkpoint.errors import CheckpointError, describe_os_error, os_error_fix, os_error_in, os_read_fix
from hetrain.checkpoint.manifest import SHARDED_DIR

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# exactly the classes a DCP Metadata is built of; a class anywhere else in DCP (a writer, a
# stager) may act when constructed, so no other is admitted
_ALLOWED = {
    (_METADATA_MODULE, "Metadata"),
    (_METADATA_MODULE, "MetadataIndex"),
    (_METADATA_MODULE, "StorageMeta"),
    (_METADATA_MODULE, "TensorStorageMetadata"),
    (_METADATA_MODULE, "BytesStorageMetadata"),
    (_METADATA_MODULE, "ChunkStorageMetadata"),
    (_METADATA_MODULE, "TensorProperties"),
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes of DCP's Metadata, torch dtypes/layouts/sizes and paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if (module, name) in _ALLOWED:
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            obj = getattr(torch, name)
        if obj is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return obj


def read_metadata_safely(path: Path) -> Any:
    """Unpickle a DCP `.metadata` file admitting only the classes of DCP's Metadata."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"{path} holds a pickled object that is not checkpoint metadata ({e}); hetrain never runs "
            f"code from a checkpoint: use a checkpoint that hetrain wrote"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP checkpoint metadata; use a "
                              f"checkpoint that hetrain wrote")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata unpickler refuses anything but DCP metadata, and which reads only
    files the checkpoint's manifest lists (`listed`, relative to the sharded directory)."""

    def __init__(self, path: str, listed: frozenset[str]) -> None:
        super().__init__(path)
        self.listed = listed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_metadata_safely(path)
        check_storage_files(metadata, self.listed, path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_storage_files(metadata: Metadata, listed: frozenset[str], path: Path) -> None:
    """Refuse metadata that points DCP at a file the manifest does not list (and so did not hash)."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name not in listed:
            raise CheckpointError(f"{path} names the data file {name!r}, which the checkpoint's manifest does not "
                                  f"list; hetrain reads only files it verified: use a checkpoint that hetrain wrote")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor values with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(
                f"sharded value {fqn!r} holds a pickled object that is not plain data; hetrain never "
                f"runs code from a checkpoint: save plain data in `sharded`"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class Stager:
    """CPU copies of sharded state (DTensors stay DTensors), made with DCP's own stager.

    With CUDA the host copies are pinned and reused between saves; when the state's structure
    changes (an optimizer gains state) a fresh copy is made.
    """

    def __init__(self) -> None:
        self._cache = torch.cuda.is_available()
        self._stager = BlockingAsyncStager(cache_staged_state_dict=self._cache)

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of `state` that later in-place updates do not change."""
        try:
            return self._stager.stage(state)
        except (KeyError, RuntimeError, ValueError, AssertionError):
            if not self._cache:
                raise
            self._stager = BlockingAsyncStager(cache_staged_state_dict=True)
            return self._stager.stage(state)


def save_sharded(state: dict[str, Any], directory: Path, process_group: Any) -> None:
    """dcp.save into `directory/sharded` (collective over `process_group`)."""
    with _quiet(process_group), _unwrapped("writing", directory):
        dcp.save(state, checkpoint_id=str(directory / SHARDED_DIR), process_group=process_group,
                 no_dist=process_group is None)


def load_sharded(template: dict[str, Any], directory: Path, process_group: Any,
                 listed: frozenset[str]) -> dict[str, Any]:
    """dcp.load into `template` in place (resharding as DCP does); returns the template.

    `listed`: the files of the sharded directory that the manifest lists (relative to it); DCP may read
    no other.
    """
    path = directory / SHARDED_DIR
    # refuse foreign objects and unlisted files before DCP touches the files
    check_storage_files(read_metadata_safely(path / ".metadata"), listed, path / ".metadata")
    with _quiet(process_group), _unwrapped("reading", directory):
        dcp.load(template, storage_reader=SafeFileSystemReader(str(path), listed), planner=SafeLoadPlanner(),
                 process_group=process_group, no_dist=process_group is None)
    return template


@contextlib.contextmanager
def _quiet(process_group: Any) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if process_group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _unwrapped(doing: str, directory: Path) -> Iterator[None]:
    """DCP gathers every rank's exception into one; surface hetrain's own error, or a short one."""
    try:
        yield
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                raise exc from None
        first = next(iter(e.failures.values()))[0]
        cause = os_error_in(first)
        if cause is not None:   # a full disk, a refused permission: what the OS said, and its fix
            fix = os_error_fix(cause) if doing == "writing" else os_read_fix(cause)
            raise CheckpointError(f"{doing} sharded state in {directory} failed on ranks {sorted(e.failures)} "
                                  f"({describe_os_error(cause)}); {fix}") from None
        raise CheckpointError(
            f"{doing} sharded state in {directory} failed on ranks {sorted(e.failures)} "
            f"({type(first).__name__}: {first}); check the directory and that the template matches the saved state"
        ) from None
