"""Damaged checkpoints: never a silent start from step 0, never counted among the kept, never outranking new saves."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hetrain.checkpoint import CheckpointError, Checkpointer, CheckpointWarning
from hetrain.vocabulary import Env
from tests.distributed import run_ranks


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(32, 32, generator=g)}, "step": step}


def _names(root: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(prefix))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _damage(step_dir: Path, how: str) -> None:
    if how == "flip a byte of shared.pt":
        _flip_byte(step_dir / "shared.pt")
    elif how == "delete the manifest":
        (step_dir / "manifest.json").unlink()
    elif how == "truncate rank-00000.pt":
        path = step_dir / "rank-00000.pt"
        path.write_bytes(path.read_bytes()[:20])


def _train(root: Path, steps: int, interval: int) -> None:
    """A job of `steps` steps checkpointing every `interval` (keep=3), as a Session does."""
    ckpt = Checkpointer(root, keep=3, async_save=True)
    for step in range(1, steps + 1):
        if step % interval == 0:
            ckpt.save(step, _state(step), {"rng": torch.tensor([step])})
    ckpt.close()


DAMAGE = ["flip a byte of shared.pt", "delete the manifest", "truncate rank-00000.pt"]


@pytest.mark.parametrize("how", DAMAGE)
def test_every_checkpoint_damaged_stops_the_job_with_one_line(tmp_path, how, monkeypatch):
    monkeypatch.delenv(Env.START_FRESH, raising=False)
    _train(tmp_path, 20, 5)
    assert _names(tmp_path, "step-") == ["step-000010", "step-000015", "step-000020"]
    for name in _names(tmp_path, "step-"):
        _damage(tmp_path / name, how)
    relaunched = Checkpointer(tmp_path, keep=3)
    with pytest.raises(CheckpointError) as e:
        relaunched.latest()
    message = str(e.value)
    assert "\n" not in message
    assert "no checkpoint in" in message and "verifies (3 damaged: step-000020:" in message
    assert "step-000015:" in message and "and 1 more" in message
    assert f"{Env.START_FRESH}=1" in message and "--start-fresh" in message
    assert _names(tmp_path, "step-") == ["step-000010", "step-000015", "step-000020"], "nothing moved or deleted"
    assert _names(tmp_path, "damaged-") == []


@pytest.mark.parametrize("how", DAMAGE[:2])
def test_starting_fresh_sets_the_damaged_aside_and_keeps_every_new_save(tmp_path, how, monkeypatch):
    _train(tmp_path, 20, 5)
    for name in _names(tmp_path, "step-"):
        _damage(tmp_path / name, how)
    monkeypatch.setenv(Env.START_FRESH, "1")  # what `hetrain launch --start-fresh` sets
    relaunched = Checkpointer(tmp_path, keep=3, async_save=True)
    with pytest.warns(CheckpointWarning, match=r"set aside as damaged-step-0000[12][05], starting from step 0"):
        assert relaunched.latest() is None
    assert _names(tmp_path, "damaged-") == ["damaged-step-000010", "damaged-step-000015", "damaged-step-000020"]
    for step in (5, 9):  # the relaunched job runs 9 steps: a save at 5, and at its end
        relaunched.save(step, _state(step), {"rng": torch.tensor([step])})
    relaunched.close()
    assert _names(tmp_path, "step-") == ["step-000005", "step-000009"], "new saves are never pruned for damaged ones"
    monkeypatch.delenv(Env.START_FRESH)
    again = Checkpointer(tmp_path)
    info = again.latest()
    assert info.step == 9 and again.load(info)[0]["step"] == 9
    assert len(_names(tmp_path, "damaged-")) == 3, "set aside for inspection, never deleted"


def test_a_damaged_newest_checkpoint_is_not_counted_among_the_kept(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    for step in (10, 20):
        ckpt.save(step, _state(step), {})
    _flip_byte(tmp_path / "step-000020" / "shared.pt")
    with pytest.warns(CheckpointWarning, match=r"step-000020 is damaged \(shared\.pt does not match its sha256"):
        assert ckpt.latest().step == 10
    ckpt.save(15, _state(15), {})
    assert _names(tmp_path, "step-") == ["step-000010", "step-000015"], "keep=2 keeps two good checkpoints"
    assert _names(tmp_path, "damaged-") == ["damaged-step-000020"]
    ckpt.save(20, _state(20), {})  # the same step again: a new checkpoint beside the damaged one
    assert _names(tmp_path, "step-") == ["step-000015", "step-000020"]
    assert torch.equal(ckpt.load()[0]["model"]["w"], _state(20)["model"]["w"])


def test_a_new_save_is_kept_even_below_a_higher_step_left_from_an_earlier_run(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    for step in (30, 40):
        ckpt.save(step, _state(step), {})
    ckpt.save(5, _state(5), {})  # a run that went back (a user's choice): its save is not deleted at once
    assert _names(tmp_path, "step-") == ["step-000005", "step-000040"]


def _all_damaged_on_two_ranks(rank: int, world: int, root: str) -> dict:
    dist.init_process_group("gloo")
    ckpt = Checkpointer(root, async_save=True)
    for step in (5, 10):
        ckpt.save(step, {"step": step}, {"rank": rank, "step": step})
    ckpt.close()
    dist.barrier()
    if rank == 1:  # only rank 1's own files are damaged: rank 0 decides, every rank must stop
        for step in (5, 10):
            _flip_byte(Path(root) / f"step-{step:06d}" / "rank-00001.pt")
    dist.barrier()
    try:
        Checkpointer(root).latest()
        stopped = None
    except CheckpointError as e:
        stopped = str(e)
    fresh = Checkpointer(root, start_fresh=True)
    with pytest.warns(CheckpointWarning) if rank == 0 else contextlib.nullcontext():
        started_over = fresh.latest() is None
    fresh.save(5, {"step": 5, "run": "new"}, {"rank": rank, "run": "new"})
    shared, per_rank, _ = fresh.load()
    fresh.close()
    return {"stopped": stopped, "started_over": started_over, "shared": shared, "per_rank": per_rank}


def test_every_rank_stops_together_and_starts_fresh_together(tmp_path):
    results = run_ranks(_all_damaged_on_two_ranks, 2, str(tmp_path))
    messages = [r["stopped"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "rank-00001.pt does not match its sha256" in messages[0] and "\n" not in messages[0]
    assert all(r["started_over"] for r in results)
    assert [r["per_rank"] for r in results] == [{"rank": 0, "run": "new"}, {"rank": 1, "run": "new"}]
    assert _names(tmp_path, "step-") == ["step-000005"]
    assert _names(tmp_path, "damaged-") == ["damaged-step-000005", "damaged-step-000010"]


def test_start_fresh_env_must_be_a_yes_or_no(tmp_path, monkeypatch):
    monkeypatch.setenv(Env.START_FRESH, "maybe")
    with pytest.raises(CheckpointError, match=f"{Env.START_FRESH}='maybe': expected 1"):
        Checkpointer(tmp_path)


def test_a_job_stopped_for_damaged_checkpoints_leaves_the_directory_free(tmp_path, monkeypatch):
    monkeypatch.delenv(Env.START_FRESH, raising=False)
    _train(tmp_path, 10, 5)
    for name in _names(tmp_path, "step-"):
        _damage(tmp_path / name, "delete the manifest")
    relaunched = Checkpointer(tmp_path)
    assert (tmp_path / "lease.json").exists()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        relaunched.latest()
    assert not (tmp_path / "lease.json").exists(), "a launch that follows (maybe on another node) need not wait"


@pytest.mark.parametrize("start_fresh", ["0", "1"])
def test_a_checkpoint_a_newer_hetrain_wrote_is_refused_not_set_aside_as_damaged(tmp_path, monkeypatch, start_fresh):
    """Its manifest's version is higher than this hetrain reads: it was called damaged, renamed damaged-step-N
    (where the newer hetrain never finds it) and the job went back to an older step, or to step 0 with
    --start-fresh."""
    import json

    monkeypatch.setenv(Env.START_FRESH, start_fresh)
    _train(tmp_path, 20, 5)
    manifest = tmp_path / "step-000020" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["version"] += 1
    manifest.write_text(json.dumps(text))
    with pytest.raises(CheckpointError, match=r"step-000020: manifest version \d+, written by a newer hetrain; this "
                                              r"one reads version \d+; resume it with the hetrain version that wrote it"):
        Checkpointer(tmp_path, keep=3).latest()
    assert _names(tmp_path, "step-") == ["step-000010", "step-000015", "step-000020"] and not _names(tmp_path, "damaged-")


@pytest.mark.parametrize("field", ["step", "bytes"])
def test_a_manifest_holding_infinity_as_a_count_is_damaged_not_an_error_of_rank_0_alone(tmp_path, field):
    """json reads Infinity; int() of it raised OverflowError out of the choice every rank waits for."""
    import json

    ckpt = Checkpointer(tmp_path, keep=3, async_save=False)
    for step in (10, 20):
        ckpt.save(step, _state(step), {})
    manifest = tmp_path / "step-000020" / "manifest.json"
    d = json.loads(manifest.read_text())
    if field == "step":
        d["step"] = float("inf")
    else:
        d["files"][0]["bytes"] = float("inf")
    manifest.write_text(json.dumps(d))   # written as Infinity
    with pytest.warns(CheckpointWarning, match=r"step-000020 is damaged \(manifest.json is malformed \(OverflowError"):
        assert ckpt.latest().step == 10
