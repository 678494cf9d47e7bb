"""A Session relaunched on a directory whose every checkpoint is damaged stops, or starts fresh when asked."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from hetrain.vocabulary import Env
from tests.distributed import run_ranks
from tests.memory.models import make_data, make_model


def _train(root: str, steps: int) -> dict:
    import hetrain

    torch.manual_seed(0)
    session = hetrain.Session(balance=False, checkpoint_dir=root, checkpoint_interval=5)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    try:
        loader = session.loader(make_data(), global_batch_size=8, seed=2)
    except hetrain.errors.HetrainError as e:
        return {"stopped": str(e)}
    start = session.step_count
    while session.step_count < steps:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count >= steps:
                break
    session.close()
    return {"start": start, "end": session.step_count}


def _job(rank: int, world: int, root: str) -> dict:
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    first = _train(root, 20)
    dist.barrier()
    if rank == 0:  # one byte of every checkpoint's shared.pt flipped
        for step_dir in sorted(Path(root).glob("step-*")):
            path = step_dir / "shared.pt"
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
    dist.barrier()
    relaunched = _train(root, 9)
    os.environ[Env.START_FRESH] = "1"  # hetrain launch --start-fresh
    fresh = _train(root, 9)
    return {"first": first, "relaunched": relaunched, "fresh": fresh}


def test_a_relaunch_on_damaged_checkpoints_stops_and_a_fresh_start_keeps_its_saves(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(_job, 2, str(root))
    assert [r["first"] for r in results] == [{"start": 0, "end": 20}] * 2
    stopped = [r["relaunched"].get("stopped") for r in results]
    assert stopped[0] is not None and stopped[0] == stopped[1] and "\n" not in stopped[0]
    assert "no checkpoint in" in stopped[0] and "3 damaged: step-000020: shared.pt does not match" in stopped[0]
    assert [r["fresh"] for r in results] == [{"start": 0, "end": 9}] * 2
    names = sorted(p.name for p in root.iterdir() if "step-" in p.name)
    assert names == ["damaged-step-000010", "damaged-step-000015", "damaged-step-000020", "step-000005",
                     "step-000009"]


def _steps(root: Path, width: int, steps: int):
    import hetrain

    session = hetrain.Session(balance=False, checkpoint_dir=str(root), checkpoint_interval=steps)
    net = make_model(width=width)
    model, _ = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    try:
        for x, y in session.loader(make_data(), global_batch_size=8, seed=2):
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count == steps:
                break
    finally:
        session.close()


def test_a_resume_with_another_model_names_the_first_parameter_and_both_shapes(tmp_path):
    """The refusal kept only torch's header ('Error(s) in loading state_dict for ...:'), not what differs."""
    import pytest

    from hetrain.errors import HetrainError

    _steps(tmp_path, 16, 2)
    with pytest.raises(HetrainError, match=r"different model or optimizer \(size mismatch for [\w.]+weight: .*"
                                           r"torch.Size\(\[16, 6\]\).*torch.Size\(\[32, 6\]\).*\(and \d+ more\)"):
        _steps(tmp_path, 32, 4)


def test_checkpoint_settings_that_cannot_work_are_refused_by_their_names(monkeypatch):
    """keep_checkpoints=0 was refused as the checkpointer's `keep=0`, at the first loader; an interval of 0
    silently meant every 100 steps."""
    import pytest

    import hetrain
    from hetrain.errors import HetrainError

    with pytest.raises(HetrainError, match="keep_checkpoints=0: .*keep_checkpoints>=1, or None"):
        hetrain.Session(checkpoint_dir="unused", keep_checkpoints=0)
    with pytest.raises(HetrainError, match="checkpoint_interval=0: pass a whole number of steps >= 1"):
        hetrain.Session(checkpoint_dir="unused", checkpoint_interval=0)
    monkeypatch.setenv(Env.CHECKPOINT_INTERVAL, "-5")
    with pytest.raises(HetrainError, match=f"{Env.CHECKPOINT_INTERVAL}=-5.*whole number >= 1"):
        hetrain.Session(checkpoint_dir="unused")
