"""A checkpoint directory holds complete checkpoints only, the last K, and survives damage."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hetrain.checkpoint import CheckpointError, Checkpointer, CheckpointWarning


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 64, generator=g)}, "step": step}


def _steps(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_keeps_the_last_k(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, async_save=True)
    for step in (10, 20, 30, 40):
        ckpt.save(step, _state(step), {"rank": 0})
    ckpt.close()
    assert _steps(tmp_path) == ["step-000030", "step-000040"]
    assert not list(tmp_path.glob(".tmp-*"))
    shared, _, _ = ckpt.load()
    assert shared["step"] == 40 and torch.equal(shared["model"]["w"], _state(40)["model"]["w"])


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(CheckpointError, match="keep=0"):
        Checkpointer(tmp_path, keep=0)


_CRASH = textwrap.dedent("""
    import os, signal, sys, torch
    from hetrain.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], async_save={async_save})
    ckpt.save(1, {{"w": torch.ones(1000)}}, {{}}, blocking=True)
    real_save = torch.save
    def dying_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)   # killed right after the first file of step 2 is written
    torch.save = dying_save
    ckpt.save(2, {{"w": torch.zeros(1000)}}, {{}})
    ckpt.wait()
""")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_crash_mid_save_leaves_no_step_directory(tmp_path, async_save):
    proc = subprocess.run([sys.executable, "-c", _CRASH.format(async_save=async_save), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _steps(tmp_path) == ["step-000001"]
    assert (tmp_path / ".tmp-step-000002").is_dir(), "the crash happened mid-save"
    ckpt = Checkpointer(tmp_path, async_save=False)  # the killed job's lease names a dead pid: taken over
    with pytest.warns(CheckpointWarning, match=r"\.tmp-step-000002 is an unfinished save of step 2"):
        info = ckpt.latest()
    assert info.step == 1
    assert torch.equal(ckpt.load(info)[0]["w"], torch.ones(1000))
    ckpt.save(3, {"w": torch.full((4,), 3.0)}, {})
    assert not list(tmp_path.glob(".tmp-*")), "the next save cleans unfinished saves away"
    assert _steps(tmp_path) == ["step-000001", "step-000003"]


def test_a_failed_write_raises_and_commits_nothing(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, _state(1), {})
    ckpt.wait()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hetrain.checkpoint.checkpointer.write_torch_file", full_disk)
    ckpt.save(2, _state(2), {})
    with pytest.raises(CheckpointError, match="No space left on device"):
        ckpt.wait()
    assert _steps(tmp_path) == ["step-000001"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_truncated_newest_checkpoint_falls_back_to_previous(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=3, async_save=False)
    for step in (1, 2):
        ckpt.save(step, _state(step), {"step": step})
    newest = tmp_path / "step-000002" / "shared.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with pytest.warns(CheckpointWarning) as caught:
        info = Checkpointer(tmp_path, async_save=False).latest()
    message = str(caught[0].message)
    assert "step-000002" in message and "shared.pt has" in message and "bytes" in message
    assert info.step == 1
    shared, per_rank, _ = ckpt.load(info)
    assert shared["step"] == 1 and per_rank == {"step": 1}


def test_same_size_corruption_is_caught_by_checksum(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, _state(1), {})
    ckpt.save(2, _state(2), {})
    path = tmp_path / "step-000002" / "rank-00000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = Checkpointer(tmp_path, async_save=False)
    with pytest.warns(CheckpointWarning, match=r"step-000002 .*rank-00000\.pt does not match its sha256.*"
                                               r"set aside as damaged-step-000002, resuming from step-000001"):
        assert fresh.latest().step == 1
    assert _steps(tmp_path) == ["step-000001"] and (tmp_path / "damaged-step-000002").is_dir()
    # asking for the damaged one by name is refused, not silently loaded
    from hetrain.checkpoint.checkpointer import _info

    with pytest.raises(CheckpointError, match="failed verification"):
        fresh.load(_info(tmp_path / "damaged-step-000002"))


def test_a_checkpoint_file_this_user_may_not_read_is_named_and_said_to_be_read_not_written(tmp_path, monkeypatch):
    """It said 'cannot look for checkpoints in DIR (Permission denied); this user may not write there'."""
    import errno

    from hetrain.checkpoint import manifest, safe_io

    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, _state(1), {})
    ckpt.save(2, _state(2), {})
    shared = tmp_path / "step-000002" / "shared.pt"
    hash_file = manifest.sha256_file

    def another_users(path):
        if Path(path) == shared:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return hash_file(path)

    monkeypatch.setattr(manifest, "sha256_file", another_users)
    with pytest.raises(CheckpointError) as e:
        Checkpointer(tmp_path, async_save=False).latest()
    assert str(e.value) == (f"cannot read {shared} while looking for checkpoints in {tmp_path} (Permission denied); "
                            "this user may not read it: fix its permissions (files another user wrote) or pass "
                            "another --checkpoint-dir")
    assert _steps(tmp_path) == ["step-000001", "step-000002"], "no damage: nothing set aside"

    def denied(path, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(safe_io.torch, "load", denied)
    with pytest.raises(CheckpointError, match=r"shared.pt cannot be read \(Permission denied\); this user may not read"):
        safe_io.read_torch_file(shared)


def test_no_checkpoint_is_none_and_a_missing_manifest_stops_the_job(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=False)
    assert ckpt.latest() is None
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt.load()
    ckpt.save(5, _state(5), {})
    (tmp_path / "step-000005" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies \(1 damaged: step-000005: no manifest"):
        ckpt.latest()
    assert _steps(tmp_path) == ["step-000005"], "a refused directory is left as it was"


def test_async_save_writes_the_state_of_the_call_not_later_updates(tmp_path):
    w = torch.zeros(1_000_000)
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, {"w": w}, {"n": 1})
    w.add_(1.0)  # training goes on while the background thread writes
    ckpt.wait()
    assert torch.equal(ckpt.load()[0]["w"], torch.zeros(1_000_000))
    assert ckpt.last_bytes > 4_000_000 and ckpt.last_save_seconds >= ckpt.last_blocking_seconds > 0


def test_an_old_checkpoint_that_cannot_be_deleted_never_looks_complete_and_is_said_once(tmp_path, monkeypatch):
    import shutil

    import hetrain.checkpoint.store as store

    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):   # a file in step 10 that cannot be deleted (another user's, NFS-busy)
        if Path(path).name == ".pruned-step-000010":
            (Path(path) / "manifest.json").unlink(missing_ok=True)
            raise PermissionError(13, "Permission denied", str(Path(path) / "shared.pt"))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(store.shutil, "rmtree", rmtree)
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    with pytest.warns(CheckpointWarning) as caught:
        for step in (10, 20, 30, 40, 50):
            ckpt.save(step, _state(step), {"rank": 0})
    said = [str(w.message) for w in caught if "could not be deleted" in str(w.message)]
    assert len(said) == 1 and ".pruned-step-000010" in said[0] and "Permission denied" in said[0], said
    assert _steps(tmp_path) == ["step-000040", "step-000050"]   # step 10 is not among the complete ones
    assert (tmp_path / ".pruned-step-000010").is_dir()
    monkeypatch.setattr(store.shutil, "rmtree", real_rmtree)   # deletable again: the next save deletes it
    ckpt.save(60, _state(60), {"rank": 0})
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("lease")) == ["step-000050", "step-000060"]
    assert ckpt.latest().step == 60


def test_an_old_checkpoint_that_fails_to_delete_two_ways_is_said_once(tmp_path, monkeypatch):
    """On NFS the first try fails 'Directory not empty' and the retry of the same prune 'Device or resource busy':
    the notice was keyed by path and reason, and came twice."""
    import errno
    import os
    import shutil

    import hetrain.checkpoint.store as store

    real_rmtree, tries = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        if Path(path).name == ".pruned-step-000001":
            tries.append(path)
            code = errno.ENOTEMPTY if len(tries) == 1 else errno.EBUSY
            raise OSError(code, os.strerror(code), str(path))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(store.shutil, "rmtree", rmtree)
    ckpt = Checkpointer(tmp_path, keep=1, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            ckpt.save(step, _state(step), {"rank": 0})
    ckpt.close()
    said = [str(w.message) for w in caught if "could not be deleted" in str(w.message)]
    assert len(tries) > 1 and len(said) == 1, said


def test_a_step_left_undeletable_before_does_not_keep_the_same_step_saved_again(tmp_path, monkeypatch):
    """A fresh start saving step 1 again, whose earlier copy could not be deleted: the rename aside met the
    old copy's name and the complete step-1 stayed past keep."""
    import shutil

    import hetrain.checkpoint.store as store

    (tmp_path / ".pruned-step-000001").mkdir()   # left by an earlier run: a file in it cannot be deleted
    (tmp_path / ".pruned-step-000001" / "shared.pt").write_bytes(b"x")
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == ".pruned-step-000001":
            raise PermissionError(1, "Operation not permitted", str(Path(path) / "shared.pt"))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(store.shutil, "rmtree", rmtree)
    ckpt = Checkpointer(tmp_path, keep=1, async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        for step in (1, 2, 3):
            ckpt.save(step, _state(step), {"rank": 0})
    ckpt.close()
    assert _steps(tmp_path) == ["step-000003"]


def test_nfs_own_files_in_a_checkpoint_do_not_make_it_damaged(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=3, async_save=False)
    for step in (1, 2):
        ckpt.save(step, _state(step), {"rank": 0})
    (tmp_path / "step-000002" / ".nfs000000000123abcd00000001").write_bytes(b"x")   # a deleted file still open
    (tmp_path / "step-000001" / "stray.pt").write_bytes(b"x")   # any other file still marks a mixed save
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.latest().step == 2
    ckpt.close()
    assert not [w for w in caught if "damaged" in str(w.message)]


def _relative_directory_and_a_change_of_directory(rank: int, world: int, root: str) -> dict:
    import os

    import hetrain
    import torch.nn.functional as F

    dist.init_process_group("gloo")
    os.chdir(root)
    (Path(root) / "elsewhere").mkdir(exist_ok=True)

    def train(steps: int) -> int:
        torch.manual_seed(0)
        session = hetrain.Session(balance=False, checkpoint_dir="ckpt", checkpoint_interval=3)
        net = torch.nn.Linear(4, 2)
        model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        loader = session.loader(data, global_batch_size=8)
        start = session.step_count
        os.chdir("elsewhere")   # the script moves on after set-up (a data folder, an output folder)
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count >= steps:
                break
        session.close()
        os.chdir(root)
        return start

    first, resumed = train(6), train(8)
    return {"first": first, "resumed": resumed, "ckpt": sorted(p.name for p in (Path(root) / "ckpt").glob("step-*")),
            "elsewhere": sorted(str(p.relative_to(root)) for p in (Path(root) / "elsewhere").rglob("*"))}


def test_a_relative_checkpoint_directory_stays_where_the_script_began(tmp_path):
    from tests.distributed import run_ranks

    result = run_ranks(_relative_directory_and_a_change_of_directory, 1, str(tmp_path))[0]
    assert result["first"] == 0 and result["resumed"] == 6, result
    assert result["ckpt"] == ["step-000003", "step-000006", "step-000008"] and result["elsewhere"] == [], result


def _resume_where_warnings_are_errors(rank, world, directory):
    import hetrain

    warnings.simplefilter("error")   # a strict script
    session = hetrain.Session(checkpoint_dir=directory)
    net = torch.nn.Linear(2, 1)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        session.loader(torch.utils.data.TensorDataset(torch.randn(8, 2)), global_batch_size=4)
        return None
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        session.close()


def test_an_unfinished_save_found_where_warnings_are_errors_stops_every_rank_naming_the_filter(tmp_path):
    """Under -W error the unfinished save's warning was raised on rank 0 alone, inside the choice every rank waits
    for: rank 1 died on a closed connection. Every rank now stops with the warning and the filter that allows it."""
    from tests.distributed import run_ranks

    (tmp_path / ".tmp-step-000002").mkdir()   # a crash mid-save
    for name, message in run_ranks(_resume_where_warnings_are_errors, 2, tmp_path, timeout=90):
        assert name == "CheckpointError", message
        assert "unfinished save of step 2" in message
        assert "warnings.filterwarnings('default', category=hetrain.checkpoint.CheckpointWarning)" in message
