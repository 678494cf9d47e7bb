"""docs/porting.md, "Continuing a run that began without hetrain", run as written with a warm-up schedule (a
LambdaLR, as every Hugging Face `get_scheduler` schedule is): the continued run takes the steps the plain torch run
would take next, at the lr its scheduler had reached. Building the scheduler after `prepare()` set the lr to the
schedule's start (0 in a warm-up) and loading its state left it there: without the recipe's loop that puts the
optimizer's saved settings back, the first continued step applied no update."""

import io

import torch
import torch.nn.functional as F

from hetrain.runtime.data_order import GlobalBatchOrder
from tests.distributed import run_ranks
from tests.runtime.test_refusals import make_data, make_net

GLOBAL, DONE, STEPS = 8, 3, 4


def _schedule(optimizer):   # linear warm-up over 5 steps, then linear decay to 0 at step 12
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: s / 5 if s < 5 else max(0.0, (12 - s) / 7))


def _earlier_run():
    """The run before hetrain: 3 AdamW steps of the schedule in one process, on other samples, saved as the
    page's DDP script saves."""
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = _schedule(optimizer)
    x, y = make_data(DONE * GLOBAL).tensors
    for step in range(DONE):
        F.cross_entropy(model(x[step * GLOBAL:(step + 1) * GLOBAL]), y[step * GLOBAL:(step + 1) * GLOBAL]).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _continued(rank, world, saved):
    import hetrain

    session = hetrain.Session()
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    # the page's recipe, line for line
    ck = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=True)   # every rank loads the same file
    model.load_state_dict(ck["model"])                 # the bare model, before prepare()
    optimizer.load_state_dict(ck["optimizer"])         # before prepare(): carried into ZeRO-1 and FSDP2
    model, optimizer = session.prepare(model, optimizer)
    scheduler = _schedule(optimizer)                    # on the optimizer prepare() returns
    scheduler.load_state_dict(ck["scheduler"])
    for group, saved in zip(optimizer.param_groups, ck["optimizer"]["param_groups"]):   # building the scheduler
        group.update({k: saved[k] for k in ("lr", "momentum", "betas") if k in saved})    # reset these: put them back
    session.add_scheduler(scheduler)
    session.scaler.load_state_dict(ck["scaler"])      # a GradScaler's state: the job's loss scale goes on
    del ck
    lrs = []
    for x, y in session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=0):
        lrs.append(optimizer.param_groups[0]["lr"])
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if session.step_count == STEPS:
            break
    params = [p.detach().clone() for p in model.module.parameters()]
    session.close()
    return {"lrs": lrs, "params": params}


def test_the_pages_recipe_goes_on_at_the_lr_the_earlier_run_reached():
    model, optimizer, scheduler = _earlier_run()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(), "epochs_done": 1}, buf)
    data, lrs = make_data(), []   # the same run, on in plain torch over the session's global batches
    order = GlobalBatchOrder(len(data), GLOBAL, shuffle=True, seed=0, drop_last=True)
    for step in range(STEPS):
        lrs.append(optimizer.param_groups[0]["lr"])
        x, y = data[order.global_batch(0, step)]
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    results = run_ranks(_continued, 2, buf.getvalue())
    assert lrs[0] > 0
    for result in results:
        assert result["lrs"] == lrs
        for mine, want in zip(result["params"], model.parameters(), strict=True):
            assert torch.allclose(mine, want.detach(), atol=1e-6), (mine - want).abs().max()
