"""A step saved again (a Session's close() after an epoch end that was also a checkpoint step) and a crash
between the two renames that replace it: the next start still finds step N, and no save prunes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hetrain.checkpoint import Checkpointer


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "lease.json")


def _crash_while_replacing(root: Path, monkeypatch) -> None:
    """Step 5 saved, then saved again with other values; the process stops right after step-000005 was renamed
    away and before .tmp-step-000005 took its name (what a kill there leaves)."""
    first = Checkpointer(root, keep=1, async_save=False)
    first.save(5, {"w": torch.ones(3), "step": 5}, {})
    real = os.rename

    def stopped_after_the_first_rename(src, dst):
        real(src, dst)
        if ".replaced-" in str(dst):
            raise SystemExit("killed")

    monkeypatch.setattr(os, "rename", stopped_after_the_first_rename)
    with pytest.raises(SystemExit):
        first.save(5, {"w": torch.full((3,), 2.0), "step": 5}, {})
    monkeypatch.setattr(os, "rename", real)
    first.close()
    assert _names(root) == [".replaced-step-000005", ".tmp-step-000005"], "the window this test is about"


def test_the_next_start_resumes_the_new_save_of_a_step_whose_replace_was_cut_off(tmp_path, monkeypatch):
    _crash_while_replacing(tmp_path, monkeypatch)
    relaunched = Checkpointer(tmp_path, keep=1, async_save=False)
    info = relaunched.latest()
    assert info is not None and info.step == 5
    shared, _, _ = relaunched.load(info)
    assert torch.equal(shared["w"], torch.full((3,), 2.0)), "the complete new save of step 5"
    relaunched.save(6, {"w": torch.zeros(3), "step": 6}, {})
    assert _names(tmp_path) == ["step-000006"]


def test_an_incomplete_new_save_gives_the_previous_step_back(tmp_path, monkeypatch):
    _crash_while_replacing(tmp_path, monkeypatch)
    (tmp_path / ".tmp-step-000005" / "manifest.json").unlink()
    relaunched = Checkpointer(tmp_path, keep=1, async_save=False)
    info = relaunched.latest()
    assert info is not None and info.step == 5
    assert torch.equal(relaunched.load(info)[0]["w"], torch.ones(3)), "the step 5 that was being replaced"


def test_a_save_before_any_look_keeps_the_cut_off_step_among_the_kept(tmp_path, monkeypatch):
    _crash_while_replacing(tmp_path, monkeypatch)
    job = Checkpointer(tmp_path, keep=2, async_save=False)   # saves without calling latest() first
    job.save(6, {"w": torch.zeros(3), "step": 6}, {})
    assert _names(tmp_path) == ["step-000005", "step-000006"]
    job.save(7, {"w": torch.zeros(3), "step": 7}, {})
    assert _names(tmp_path) == ["step-000006", "step-000007"]


def test_an_old_copy_left_behind_after_its_step_was_pruned_is_never_put_back(tmp_path):
    """A .replaced-step-N a failed delete left behind (a file of another user's in it), its step-N pruned since,
    perhaps half deleted: it was renamed back to step-N, a checkpoint only verification could tell from a good
    one (found in review). Only the commit's own window, its new save beside it, is put back."""
    from hetrain.checkpoint.store import restore_replaced

    left = tmp_path / ".replaced-step-000001"
    left.mkdir()
    (left / "rank-00000.pt").write_bytes(b"half deleted")
    assert restore_replaced(tmp_path) == []
    assert _names(tmp_path) == [".replaced-step-000001"]
