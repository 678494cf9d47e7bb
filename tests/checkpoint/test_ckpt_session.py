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
