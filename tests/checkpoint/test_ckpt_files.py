"""What a checkpoint file may hold, and that loading never runs code from it."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hetrain.checkpoint import CheckpointError, Checkpointer, capture_rng, restore_rng
from hetrain.checkpoint.manifest import read_manifest
from hetrain.checkpoint.safe_io import check_savable, read_torch_file, sha256_file, snapshot
from tests.distributed import run_ranks


class Intruder:
    """A class a checkpoint must never instantiate."""

    def __init__(self) -> None:
        self.secret = 42

    def __setstate__(self, state):  # pragma: no cover - the test fails if this ever runs
        raise AssertionError("code from a checkpoint ran")


def test_plain_values_round_trip(tmp_path):
    value = {
        "model": OrderedDict(w=torch.randn(3, 4), b=torch.zeros(4, dtype=torch.bfloat16)),
        "misc": [1, 2.5, True, None, "s", b"raw", (1, 2), torch.float16, torch.device("cpu"), torch.Size([2, 3])],
    }
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, value, {"r": 0})
    shared, per_rank, sharded = ckpt.load()
    assert isinstance(shared["model"], OrderedDict)
    assert torch.equal(shared["model"]["w"], value["model"]["w"])
    assert shared["model"]["b"].dtype == torch.bfloat16
    assert shared["misc"] == value["misc"]
    assert per_rank == {"r": 0} and sharded is None


@pytest.mark.parametrize("bad, where", [
    ({"a": np.float64(1.0)}, "shared['a']"),
    ({"a": [1, {"b": Intruder()}]}, "shared['a'][1]['b']"),
    ({"a": {1, 2}}, "shared['a']"),
    ({(1, 2): 3}, "shared"),
])
@pytest.mark.parametrize("async_save", [False, True])
def test_save_refuses_values_that_would_need_unpickling(tmp_path, bad, where, async_save):
    ckpt = Checkpointer(tmp_path, async_save=async_save)
    with pytest.raises(CheckpointError) as e:   # at this save(), not the next one 100 steps later
        ckpt.save(1, bad, {})
    assert where in str(e.value)
    ckpt.save(2, {"a": 1.0}, {})   # the refusal is not raised again
    ckpt.close()
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000002"]


def test_check_savable_refuses_what_save_refuses():
    w = torch.ones(3)
    check_savable({"w": w, "n": [1, 2.5, None]})
    with pytest.raises(CheckpointError, match=r"session.add_state\('best'\)\['v'\] is a numpy.float64"):
        check_savable({"v": np.float64(1.0)}, where="session.add_state('best')")


def _one_rank_saves_a_set(rank: int, world: int, root: str) -> dict:
    dist.init_process_group("gloo")
    ckpt = Checkpointer(root, async_save=True)
    try:
        ckpt.save(1, {"w": torch.ones(2)}, {"seen": {1, 2} if rank == 1 else [1, 2]})
        refused = None
    except CheckpointError as e:
        refused = str(e)
    ckpt.save(2, {"w": torch.ones(2)}, {"seen": [1, 2]})
    ckpt.close()
    return {"refused": refused}


def test_every_rank_refuses_at_the_save_where_one_rank_holds_a_value_that_cannot_be_saved(tmp_path):
    results = run_ranks(_one_rank_saves_a_set, 2, str(tmp_path))
    assert all(r["refused"] is not None and "per_rank['seen'] is a builtins.set" in r["refused"] for r in results)
    assert results[0]["refused"].startswith("rank 1: ")
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000002"]


def test_snapshot_copy_detaches_from_later_updates():
    w = torch.ones(4)
    tied = {"a": w, "b": w}
    snap = snapshot(tied, copy=True)
    w.add_(1)
    assert torch.equal(snap["a"], torch.ones(4))
    assert snap["a"] is snap["b"], "a tensor saved twice stays one tensor (tied weights)"
    view = torch.arange(10.0)[2:5]
    assert snapshot(view, copy=False).untyped_storage().nbytes() == 3 * 4, "views are written compactly"


def test_foreign_class_in_a_checkpoint_is_refused(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(3, {"w": torch.ones(2)}, {})
    step_dir = tmp_path / "step-000003"
    # a file crafted outside hetrain: plain torch.save of an object of a foreign class, with a
    # manifest that matches it, so only the safe loader stands between it and code execution
    torch.save({"w": torch.ones(2), "payload": Intruder()}, step_dir / "shared.pt")
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "shared.pt":
            entry["bytes"], entry["sha256"] = sha256_file(step_dir / "shared.pt")
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    info = ckpt.latest()
    assert info is not None and info.step == 3
    with pytest.raises(CheckpointError, match=r"shared\.pt holds a pickled object of class [\w.]*Intruder"):
        ckpt.load(info)
    with pytest.raises(CheckpointError, match="never runs code"):
        read_torch_file(step_dir / "shared.pt")
    assert read_manifest(step_dir).step == 3


def test_rng_capture_restore_reproduces_draws(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()
    state = capture_rng()
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(0, {}, {"rng": state})
    first = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
             torch.rand(3).tolist(), torch.randint(0, 1000, (4,)).tolist())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    _, per_rank, _ = Checkpointer(tmp_path, async_save=False).load()
    restore_rng(per_rank["rng"])
    again = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
             torch.rand(3).tolist(), torch.randint(0, 1000, (4,)).tolist())
    assert again == first


def test_restore_rng_names_a_malformed_state():
    with pytest.raises(CheckpointError, match="capture_rng"):
        restore_rng({"python": {}})
