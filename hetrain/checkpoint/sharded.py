"""Sharded state (ZeRO / FSDP2 / DTensor) through torch.distributed.checkpoint, read safely.

DCP itself reads its `.metadata` with `pickle.load` and non-tensor values with
`torch.load(weights_only=False)`. hetrain configures DCP with a reader whose unpickler admits only
DCP's own metadata classes and a planner that reads values with `weights_only=True`, so loading a
checkpoint never runs code from it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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


class SafeFileSystemReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata unpickler refuses anything but DCP metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"{path} holds a pickled object that is not checkpoint metadata ({e}); hetrain never runs "
                f"code from a checkpoint: use a checkpoint that hetrain wrote"
            ) from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

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


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of sharded state (DTensors stay DTensors), made with DCP's own stager."""
    return BlockingAsyncStager().stage(state)


def save_sharded(state: dict[str, Any], directory: Path, process_group: Any) -> None:
    """dcp.save into `directory/sharded` (collective over `process_group`)."""
    dcp.save(state, checkpoint_id=str(directory / SHARDED_DIR), process_group=process_group,
             no_dist=process_group is None)


def load_sharded(template: dict[str, Any], directory: Path, process_group: Any) -> dict[str, Any]:
    """dcp.load into `template` in place (resharding as DCP does); returns the template."""
    path = directory / SHARDED_DIR
    dcp.load(template, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
             process_group=process_group, no_dist=process_group is None)
    return template
