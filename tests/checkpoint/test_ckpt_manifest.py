"""A checkpoint is trusted only where its manifest and its directory agree, and every file read is listed and hashed."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hetrain.checkpoint import CheckpointError, Checkpointer, CheckpointWarning
from hetrain.checkpoint.safe_io import sha256_file
from tests.distributed import run_ranks


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, generator=g), "step": step}


def _edit(step_dir: Path, change) -> None:
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _flip_shared(step_dir: Path) -> None:
    path = step_dir / "shared.pt"
    data = bytearray(path.read_bytes())
    data[-200] ^= 0x01  # inside the tensor's bytes: the file still loads, with other weights
    path.write_bytes(bytes(data))


def _files_empty(d: Path) -> None:
    _flip_shared(d)
    _edit(d, lambda m: m.update(files=[]))


def _shared_unlisted(d: Path) -> None:
    _flip_shared(d)
    _edit(d, lambda m: m.update(files=[f for f in m["files"] if f["path"] != "shared.pt"]))


def _extra_rank_file(d: Path) -> None:
    (d / "rank-00001.pt").write_bytes((d / "rank-00000.pt").read_bytes())


def _listed_twice(d: Path) -> None:
    _edit(d, lambda m: m.update(files=m["files"] + m["files"][:1]))


def _unknown_file(d: Path) -> None:
    (d / "notes.txt").write_text("hello")
    size, sha = sha256_file(d / "notes.txt")
    _edit(d, lambda m: m["files"].append({"path": "notes.txt", "bytes": size, "sha256": sha}))


BAD = {
    "files: [] and shared.pt bit-flipped": (_files_empty, r"manifest does not list shared\.pt"),
    "shared.pt left out of files and bit-flipped": (_shared_unlisted, r"manifest does not list shared\.pt"),
    "world_size 2 for a 1-rank checkpoint": (lambda d: _edit(d, lambda m: m.update(world_size=2)),
                                             r"world_size 2 but lists 1 rank files \(lacks rank-00001\.pt"),
    "world_size 10**9 (a set of its names would fill memory)": (
        lambda d: _edit(d, lambda m: m.update(world_size=10**9)),
        r"world_size 1000000000 but lists 1 rank files \(lacks rank-00001\.pt, rank-00002\.pt, rank-00003\.pt\)"),
    "world_size 0": (lambda d: _edit(d, lambda m: m.update(world_size=0)), r"world_size 0"),
    "a rank file the manifest does not list": (_extra_rank_file, r"rank-00001\.pt is in the directory but not in"),
    "a file listed twice": (_listed_twice, r"lists a file twice"),
    "sharded: true without sharded files": (lambda d: _edit(d, lambda m: m.update(sharded=True)),
                                            r"sharded=true but lists 0 sharded files"),
    "sharded: 'yes'": (lambda d: _edit(d, lambda m: m.update(sharded="yes")), r"sharded is 'yes'"),
    "a listed file that is no checkpoint file": (_unknown_file, r"lists notes\.txt, which is no checkpoint file"),
    "step 3 in step-000002": (lambda d: _edit(d, lambda m: m.update(step=3)), r"manifest says step 3, the directory"),
    "a path out of the directory": (lambda d: _edit(d, lambda m: m["files"][0].update(path="../x.pt")),
                                    r"leaves the checkpoint directory"),
    "not JSON": (lambda d: (d / "manifest.json").write_text("{"), r"malformed"),
    "another format": (lambda d: _edit(d, lambda m: m.update(format="other")), r"not a hetrain-checkpoint manifest"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_manifest_that_disagrees_with_its_checkpoint_is_passed_over(tmp_path, case):
    damage, reason = BAD[case]
    ckpt = Checkpointer(tmp_path, async_save=False)
    for step in (1, 2):
        ckpt.save(step, _state(step), {"step": step})
    damage(tmp_path / "step-000002")
    fresh = Checkpointer(tmp_path, async_save=False)
    with pytest.warns(CheckpointWarning, match=rf"step-000002 is damaged \(.*{reason}"):
        info = fresh.latest()
    assert info.step == 1
    shared, per_rank, _ = fresh.load(info)
    assert torch.equal(shared["w"], _state(1)["w"]) and per_rank == {"step": 1}


def test_a_manifest_changed_after_latest_is_checked_again_at_load(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, _state(1), {})
    info = ckpt.latest()
    _files_empty(tmp_path / "step-000001")
    with pytest.raises(CheckpointError, match=r"failed verification: manifest does not list shared\.pt"):
        ckpt.load(info)


def _world_size_edited(rank: int, world: int, root: str) -> dict:
    dist.init_process_group("gloo")
    ckpt = Checkpointer(root, async_save=True)
    for step in (1, 2, 3):
        ckpt.save(step, {"step": step}, {"rank": rank, "step": step})
    ckpt.wait()
    if rank == 0:  # world_size edited to 1: rank 1 would keep a fresh RNG state instead of its own
        _edit(Path(root) / "step-000003", lambda m: m.update(world_size=1))
        _edit(Path(root) / "step-000002", lambda m: m.update(
            world_size=1, files=[f for f in m["files"] if f["path"] != "rank-00001.pt"]))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = ckpt.latest()
    _, per_rank, _ = ckpt.load(info)
    ckpt.close()
    return {"step": info.step, "per_rank": per_rank, "warned": [str(w.message) for w in caught]}


def test_a_world_size_that_disagrees_with_the_rank_files_is_refused_on_every_rank(tmp_path):
    results = run_ranks(_world_size_edited, 2, str(tmp_path))
    assert [r["step"] for r in results] == [1, 1]
    assert [r["per_rank"] for r in results] == [{"rank": 0, "step": 1}, {"rank": 1, "step": 1}]
    warned = " ".join(results[0]["warned"])
    assert "step-000003 is damaged (manifest says world_size 1 but also lists rank-00001.pt)" in warned
    assert "step-000002 is damaged (rank-00001.pt is in the directory but not in the manifest)" in warned


def _rehash(step_dir: Path, name: str) -> None:
    size, sha = sha256_file(step_dir / name)
    _edit(step_dir, lambda m: [f.update(bytes=size, sha256=sha) for f in m["files"] if f["path"] == name])


class _MakesADirectory:
    """Pickles as a call of a DCP class whose constructor creates a directory named by the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        from torch.distributed.checkpoint.staging import _ReplicationStager

        return _ReplicationStager, (None, 5, "cpu", self.path)


def test_dcp_metadata_constructs_nothing_with_side_effects(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(1, {}, {}, sharded={"t": torch.ones(3)})
    step_dir = tmp_path / "ckpt" / "step-000001"
    chosen = tmp_path / "chosen-by-the-file"
    (step_dir / "sharded" / ".metadata").write_bytes(pickle.dumps(_MakesADirectory(str(chosen))))
    _rehash(step_dir, "sharded/.metadata")
    with pytest.raises(CheckpointError, match=r"not checkpoint metadata .*_ReplicationStager"):
        ckpt.load(sharded_template={"t": torch.zeros(3)})
    assert not chosen.exists()


def test_dcp_metadata_may_name_only_data_files_the_manifest_lists(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {"secret": torch.arange(4.0)}, {}, sharded={"t": torch.ones(3)})
    step_dir = tmp_path / "step-000001"
    path = step_dir / "sharded" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../shared.pt"  # a file that is hashed, but is no part of the sharded state
    path.write_bytes(pickle.dumps(metadata))
    _rehash(step_dir, "sharded/.metadata")
    with pytest.raises(CheckpointError, match=r"names the data file '\.\./shared\.pt', which the checkpoint's "
                                              r"manifest does not list"):
        ckpt.load(sharded_template={"t": torch.zeros(3)})
