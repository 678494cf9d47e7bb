"""A run that began without hetrain goes on under a pipeline plan: the model's weights and the optimizer's state
loaded before session.prepare() (each stage keeps its own parameters' state, sharded with them under FSDP2) give
the update one process would make next, and the stage's checkpoints save."""

import io

import pytest
import torch
from torch.nn import functional as F

from hetrain.runtime.data import GlobalBatchOrder
from tests.distributed import run_ranks
from tests.pipeline.common import make_data, make_model, pipeline_plan, worst_difference

STEPS, GLOBAL = 3, 12


def _earlier_run():
    """3 AdamW steps in one process, on other samples: the run the script continues."""
    model, data = make_model(), make_data(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        x, y = data[step * GLOBAL:(step + 1) * GLOBAL]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _continued(rank, world, plan, saved, checkpoint_dir):
    import hetrain

    saved = torch.load(io.BytesIO(saved))
    session = hetrain.Session(plan, checkpoint_dir=checkpoint_dir, checkpoint_interval=1, async_checkpoints=False)
    net = make_model()
    net.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    optimizer.load_state_dict(saved["optimizer"])
    model, _ = session.prepare(net, optimizer)
    states = []
    for x, y in session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0):
        session.forward_backward(x, y, F.cross_entropy)
        session.step()
        inner = getattr(model, "module", model)
        states.append({k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                       for k, v in inner.state_dict().items()})
        if session.step_count == STEPS:
            break
    session.close()
    return {"states": states}


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_optimizer_state_loaded_before_prepare_goes_on_in_each_stage(tmp_path, sharding):
    """Loaded state failed at the first checkpoint (a KeyError for another stage's parameter) without sharding,
    and was refused under FSDP2 ('the optimizer already holds state')."""
    model, opt = _earlier_run()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    data = make_data()
    order = GlobalBatchOrder(len(data), GLOBAL, shuffle=True, seed=0, drop_last=True)
    want = []
    for step in range(STEPS):
        x, y = data[order.global_batch(0, step)]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        want.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    if sharding == "none":
        plan, world = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=2, global_batch=GLOBAL), 2
    else:
        plan = pipeline_plan([[0, 3], [3, 8]], "1f1b", microbatches=2, global_batch=GLOBAL, replica_shares=[8, 4])
        plan, world = plan.model_copy(update={"sharding": "fsdp"}), 4
    results = run_ranks(_continued, world, plan, buf.getvalue(), str(tmp_path / "ckpt"))
    assert worst_difference(results, want) < 1e-5
