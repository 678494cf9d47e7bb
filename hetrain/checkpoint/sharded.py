"""Sharded state (ZeRO / FSDP2 / DTensor) through torch.distributed.checkpoint, read safely.

DCP itself reads its `.metadata` with `pickle.load` and non-tensor values with
`torch.load(weights_only=False)`. hetrain configures DCP with a reader whose unpickler admits only
DCP's own metadata classes and a planner that reads values with `weights_only=True`, so loading a
checkpoint never runs code from it.
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
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from hetrain.checkpoint.errors import CheckpointError

SHARDED_DIR = "sharded"
_DCP_MODULES = ("torch.distributed.checkpoint.", "torch.distributed.tensor.")
_ALLOWED = {
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
    """Admits DCP's metadata classes, torch dtypes/layouts/sizes and paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if (module, name) in _ALLOWED:
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            obj = getattr(torch, name)
        elif module.startswith(_DCP_MODULES):
            candidate = super().find_class(module, name)
            # classes only (metadata dataclasses and enums), never functions
            if isinstance(candidate, type):
                obj = candidate
        if obj is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return obj


def read_metadata_safely(path: Path) -> Any:
    """Unpickle a DCP `.metadata` file admitting only DCP's metadata classes."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds a pickled object that is not checkpoint metadata ({e}); hetrain never runs "
            f"code from a checkpoint: use a checkpoint that hetrain wrote"
        ) from None


class SafeFileSystemReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata unpickler refuses anything but DCP metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_metadata_safely(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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


def load_sharded(template: dict[str, Any], directory: Path, process_group: Any) -> dict[str, Any]:
    """dcp.load into `template` in place (resharding as DCP does); returns the template."""
    path = directory / SHARDED_DIR
    read_metadata_safely(path / ".metadata")  # refuse foreign objects before DCP touches the files
    with _quiet(process_group), _unwrapped("reading", directory):
        dcp.load(template, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
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
        raise CheckpointError(
            f"{doing} sharded state in {directory} failed on ranks {sorted(e.failures)} "
            f"({type(first).__name__}: {first}); check the directory and that the template matches the saved state"
        ) from None
