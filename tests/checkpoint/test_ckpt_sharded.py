"""Sharded state through torch.distributed.checkpoint, read without unpickling foreign objects."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hetrain.checkpoint import CheckpointError, Checkpointer
from hetrain.checkpoint.safe_io import sha256_file


class Intruder:
    """A class a checkpoint must never instantiate."""

    def __setstate__(self, state):  # pragma: no cover - the test fails if this ever runs
        raise AssertionError("code from a checkpoint ran")


def _rehash(step_dir, name):
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == name:
            entry["bytes"], entry["sha256"] = sha256_file(step_dir / name)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_single_process_sharded_round_trip(tmp_path):
    state = {"t": torch.arange(6.0), "meta": {"lr": 0.1, "betas": (0.9, 0.99)}}
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, {"s": 1}, {}, sharded=state)
    state["t"].add_(100)  # after the call returns the background copy is already taken
    ckpt.wait()
    template = {"t": torch.zeros(6), "meta": {"lr": 0.0, "betas": (0.0, 0.0)}}
    _, _, loaded = ckpt.load(sharded_template=template)
    assert torch.equal(loaded["t"], torch.arange(6.0))
    assert loaded["meta"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    files = json.loads((tmp_path / "step-000001" / "manifest.json").read_text())["files"]
    assert any(f["path"] == "sharded/.metadata" for f in files), "DCP's files are in the manifest"


def test_foreign_object_in_dcp_metadata_is_refused(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {}, {}, sharded={"t": torch.ones(3)})
    step_dir = tmp_path / "step-000001"
    (step_dir / "sharded" / ".metadata").write_bytes(pickle.dumps(Intruder()))
    _rehash(step_dir, "sharded/.metadata")
    with pytest.raises(CheckpointError, match=r"not checkpoint metadata .*Intruder"):
        ckpt.load(sharded_template={"t": torch.zeros(3)})


def test_foreign_object_in_a_dcp_value_is_refused(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {}, {}, sharded={"t": torch.ones(3), "x": 5})
    step_dir = tmp_path / "step-000001"
    # the same checkpoint rewritten by plain DCP, with an object of a foreign class as a value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"t": torch.ones(3), "x": Intruder()}, checkpoint_id=str(step_dir / "sharded"), no_dist=True)
    for path in (step_dir / "sharded").iterdir():
        _rehash(step_dir, f"sharded/{path.name}")
    with pytest.raises(CheckpointError, match=r"sharded value 'x' holds a pickled object"):
        ckpt.load(sharded_template={"t": torch.zeros(3), "x": 0})


def test_template_without_sharded_state_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {}, {})
    with pytest.raises(CheckpointError, match="holds no sharded state"):
        ckpt.load(sharded_template={"t": torch.zeros(3)})


def test_a_full_disk_while_writing_sharded_state_says_so(tmp_path, monkeypatch):
    """It said '(OSError: [Errno 28] ...); check the directory and that the template matches the saved state'."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_files

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", full)
    ckpt = Checkpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match=r"writing sharded state in .* failed on ranks \[0\] \(No space left on "
                                              r"device\); the filesystem is full: free space or pass a --checkpoint-dir"):
        ckpt.save(1, {"s": 1}, {}, sharded={"t": torch.arange(6.0)})
