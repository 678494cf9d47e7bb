"""Several ranks over gloo: background saves, sharded state through DCP, agreement on the checkpoint."""

from __future__ import annotations

import hashlib
import statistics
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from hetrain.checkpoint import CheckpointError, Checkpointer, CheckpointWarning, capture_rng
from tests.distributed import run_ranks


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _async_vs_sync(rank: int, world: int, root: str) -> dict:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(2500, 5000)  # 12.5 M float32 parameters: 50 MB
    sync = Checkpointer(Path(root) / "sync", async_save=False)
    background = Checkpointer(Path(root) / "async", async_save=True)
    sync_block, async_block, async_total, saved = [], [], [], []
    for step in (1, 2, 3):
        per_rank = {"rng": capture_rng(), "local": torch.full((8,), float(rank + step))}
        shared = {"model": model.state_dict(), "step": step}
        sync.save(step, shared, per_rank)
        sync_block.append(sync.last_blocking_seconds)
        background.save(step, shared, per_rank)
        async_block.append(background.last_blocking_seconds)
        saved.append(model.weight[0, :4].clone())
        with torch.no_grad():  # training goes on while the background thread writes
            model.weight.add_(1.0)
            model.bias.mul_(-1.0)
        background.wait()
        async_total.append(background.last_save_seconds)
    shared, per_rank, _ = background.load(rank=rank)
    loaded_ok = torch.equal(shared["model"]["weight"][0, :4], saved[-1]) and shared["step"] == 3
    own_ok = torch.equal(per_rank["local"], torch.full((8,), float(rank + 3)))
    # A background save() hands the writing to a thread and returns: held back here, its step is not yet written
    held = Checkpointer(Path(root) / "held", async_save=True)
    gate, write = threading.Event(), held._write
    held._write = lambda *args: (gate.wait(120), write(*args))
    held.save(4, {"model": model.state_dict(), "step": 4}, {"rng": capture_rng(), "local": torch.zeros(8)})
    returned_first = not (Path(root) / "held" / "step-000004").exists()
    gate.set()
    held.close()
    return {"sync": sync_block, "async": async_block, "async_total": async_total, "bytes": background.last_bytes,
            "loaded_ok": loaded_ok, "own_ok": own_ok, "returned_first": returned_first,
            "written": (Path(root) / "held" / "step-000004" / "shared.pt").exists()}


def test_background_save_writes_the_same_bytes_and_returns_before_writing(tmp_path):
    """What the loop waits for in each (the figures printed) is a benchmark's: `hetrain bench recover` prints
    `blocking_ratio`. A ratio asserted here failed under the load of a full test run (0.29 against 0.2)."""
    results = run_ranks(_async_vs_sync, 2, str(tmp_path))
    for step in (1, 2, 3):
        name = f"step-{step:06d}"
        for file in ("shared.pt", "rank-00000.pt", "rank-00001.pt"):
            assert _sha(tmp_path / "sync" / name / file) == _sha(tmp_path / "async" / name / file), (name, file)
    assert all(r["loaded_ok"] and r["own_ok"] for r in results)
    r0 = results[0]  # rank 0 writes the 50 MB shared file
    assert r0["bytes"] > 50_000_000
    sync = statistics.median(r0["sync"])
    first_ratio = r0["async"][0] / sync
    steady_ratio = statistics.median(r0["async"][1:]) / sync
    print(f"\n50 MB, 2 gloo ranks: synchronous save blocks {sync * 1e3:.0f} ms; background save blocks "
          f"{r0['async'][0] * 1e3:.0f} ms on the first save (ratio {first_ratio:.3f}), "
          f"{statistics.median(r0['async'][1:]) * 1e3:.0f} ms after (ratio {steady_ratio:.3f}); "
          f"background total {statistics.median(r0['async_total']) * 1e3:.0f} ms")
    assert all(r["returned_first"] and r["written"] for r in results), results


def _sharded(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(48.0).reshape(8, 6)
    table = distribute_tensor(full.clone(), mesh, [Shard(0)])

    def zero_after_one_step(seed: int) -> ZeroRedundancyOptimizer:
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 4)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
        torch.manual_seed(seed + rank)
        model(torch.randn(5, 6)).square().sum().backward()
        zero.step()
        return zero

    zero = zero_after_one_step(1)
    ckpt = Checkpointer(root, async_save=True)
    ckpt.save(7, {"step": 7}, {"rank": rank}, sharded={"table": table, f"zero.rank{rank}": zero.optim.state_dict()})
    with torch.no_grad():
        table.to_local().add_(1000.0)  # must not reach the checkpoint being written
    ckpt.wait()

    other = zero_after_one_step(2)  # same structure, other values: the template to load into
    template_table = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)])
    template = {"table": template_table, f"zero.rank{rank}": other.optim.state_dict()}
    info = ckpt.latest()
    shared, per_rank, loaded = ckpt.load(info, rank=rank, sharded_template=template)
    other.optim.load_state_dict(loaded[f"zero.rank{rank}"])
    saved_state, loaded_state = zero.optim.state_dict(), other.optim.state_dict()
    zero_equal = saved_state["param_groups"] == loaded_state["param_groups"] and all(
        torch.equal(saved_state["state"][i][k], loaded_state["state"][i][k])
        for i in saved_state["state"] for k in saved_state["state"][i])
    return {"table_equal": torch.equal(loaded["table"].full_tensor(), full), "zero_equal": zero_equal,
            "n_state": len(saved_state["state"]), "shared": shared, "per_rank": per_rank, "step": info.step}


def test_sharded_state_through_dcp_with_two_ranks(tmp_path):
    results = run_ranks(_sharded, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["table_equal"] and r["zero_equal"] and r["n_state"] >= 1
        assert r["shared"] == {"step": 7} and r["per_rank"] == {"rank": rank} and r["step"] == 7
    # the same checkpoint read back by one process: DCP reshards the 2-rank table into a full tensor
    ckpt = Checkpointer(tmp_path, async_save=False)
    shared, per_rank, loaded = ckpt.load(rank=0, sharded_template={"table": torch.zeros(8, 6)})
    assert torch.equal(loaded["table"], torch.arange(48.0).reshape(8, 6))
    assert per_rank == {"rank": 0}
    assert ckpt.load(rank=2)[1] is None, "a rank the checkpoint did not have gets no per-rank state"


def _agree(rank: int, world: int, root: str) -> dict:
    dist.init_process_group("gloo")
    ckpt = Checkpointer(root, async_save=True)
    for step in (1, 2):
        ckpt.save(step, {"step": step}, {"rank": rank, "step": step})
    ckpt.wait()
    if rank == 1:  # one rank's file of the newest checkpoint is damaged
        path = Path(root) / "step-000002" / "rank-00001.pt"
        path.write_bytes(path.read_bytes()[:10])
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = ckpt.latest()
    shared, per_rank, _ = ckpt.load(info, rank=rank)
    return {"step": info.step, "shared": shared, "per_rank": per_rank,
            "warned": [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]}


def test_ranks_agree_on_the_newest_good_checkpoint(tmp_path):
    results = run_ranks(_agree, 2, str(tmp_path))
    assert [r["step"] for r in results] == [1, 1]
    assert [r["per_rank"] for r in results] == [{"rank": 0, "step": 1}, {"rank": 1, "step": 1}]
    assert any("step-000002" in w and "rank-00001.pt" in w for w in results[0]["warned"])


def _own_directories(rank: int, world: int, root: str, shared: bool) -> str | None:
    """Two nodes (GROUP_RANK), each given its own --checkpoint-dir as on two hosts' local disks, or one."""
    import os

    import hetrain.checkpoint.checkpointer as checkpointer
    from hetrain.checkpoint.errors import CheckpointError

    os.environ["GROUP_RANK"] = str(rank)
    checkpointer.SHARED_WAIT_SECONDS = 1.0
    dist.init_process_group("gloo")
    try:
        Checkpointer(Path(root) / ("shared" if shared else f"node{rank}")).close()
    except CheckpointError as e:
        return str(e)
    return None


def test_nodes_that_do_not_share_the_checkpoint_directory_are_refused_before_training(tmp_path):
    """Caught at the first save (step 100 by default), and each restart trained those steps again."""
    errors = run_ranks(_own_directories, 2, str(tmp_path), False)
    assert all(e is not None and "rank 1: it does not see the lease rank 0 took" in e
               and "on a file system all nodes share" in e for e in errors), errors
    assert run_ranks(_own_directories, 2, str(tmp_path), True) == [None, None]
    assert not (tmp_path / "node0" / "lease.json").exists()   # let go when refused
    from hetrain.checkpoint import lease

    assert lease.seen_within(tmp_path / "nowhere", "token", 0.0) == (False, None)


def _newer_manifest(rank: int, world: int, root: str) -> str:
    import json

    dist.init_process_group("gloo")
    ckpt = Checkpointer(root, async_save=False)
    ckpt.save(1, {"w": torch.ones(2)}, {"rank": rank})
    if rank == 0:   # as a newer hetrain would have written it
        manifest = Path(root) / "step-000001" / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 999}))
    dist.barrier()
    try:
        ckpt.latest()
        return "resumed"
    except CheckpointError as e:
        return str(e)


def test_a_checkpoint_of_a_newer_hetrain_stops_every_rank_with_its_refusal(tmp_path):
    """Rank 0 alone raised it, inside the choice every rank waits for: rank 1 died on a closed connection."""
    said = run_ranks(_newer_manifest, 2, str(tmp_path), timeout=60)
    assert all("manifest version 999, written by a newer hetrain" in s for s in said), said


def _undeletable_old_checkpoint_under_strict_filters(rank: int, world: int, root: str) -> list:
    from hetrain.checkpoint import store

    dist.init_process_group("gloo")
    pruned = store.prune
    store.prune = lambda directory, keep, newest=None: (pruned(directory, keep, newest=newest)[0],
                                                        {"step-000000": "Permission denied"})
    ckpt = Checkpointer(root, async_save=rank == 1)
    warnings.simplefilter("error")   # a strict script
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((2,), float(step))}, {"rank": rank})
    ckpt.wait()
    return [ckpt.latest().step]


def test_an_old_checkpoint_left_undeletable_under_strict_warning_filters_fails_no_save(tmp_path):
    """The notice came after the step was committed, on rank 0 alone: under -W error rank 0's save raised and
    rank 1 died on a closed connection, and every later save raised again. It is now logged there instead."""
    assert run_ranks(_undeletable_old_checkpoint_under_strict_filters, 2, str(tmp_path), timeout=60) == [[2], [2]]
