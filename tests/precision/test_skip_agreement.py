"""A step with a non-finite gradient anywhere is skipped on every rank, once.

Two ways it went wrong: under ZeRO-1 a gradient the script changed on one rank after backward was
judged by that rank alone (it skipped the step's broadcast and the job hung), and a compressing
all-reduce hid an overflow (int8 sent it as zeros) or kept it in the error it carries to later steps
(every later step overflowed, and the job stopped).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hetrain.planning.plan import BalancePlan, CommPlan, Plan, RankPlan
from tests.distributed import run_ranks
from tests.precision.test_mixed_precision import GLOBAL, PRECISIONS, SEED, SHARES, full_loss, make_data, make_model

STEPS = 12
BAD_STEP = 4


def _plan(sharding: str, compression: str) -> Plan:
    comm = CommPlan(compression=compression, powersgd_warmup_steps=2, topk_ratio=0.25)
    return Plan(global_batch_size=GLOBAL, sharding=sharding, comm=comm, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, precision=p) for r, (s, p) in enumerate(zip(SHARES, PRECISIONS))])


def _train(rank, world, sharding, compression, how, bad_step=BAD_STEP):
    import hetrain
    from hetrain.errors import HetrainError

    session = hetrain.Session(_plan(sharding, compression))
    net = make_model()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=GLOBAL, shuffle=True, seed=SEED)
    applied, params = [], []
    try:
        _steps(session, model, net, loader, rank, how, applied, params, bad_step)
    except HetrainError as e:
        session.close()
        return {"applied": applied, "error": str(e)}
    session.close()
    return {"applied": applied, "params": params, "loss": full_loss(net)}


def _steps(session, model, net, loader, rank, how, applied, params, bad_step):
    while len(applied) < STEPS:
        for x, y in loader:
            bad = len(applied) == bad_step and rank == 1
            handle = net[2].weight.register_hook(lambda g: g * float("inf")) if bad and how == "overflow" else None
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
            if handle is not None:
                handle.remove()
            if bad and how == "edit":   # the script's own change of this rank's gradient, after backward
                grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in net.parameters()]
                next(g for g in grads if g.numel()).view(-1)[0] = float("inf")   # a shard this rank holds
            applied.append(session.step())
            params.append(torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                                     for p in net.parameters()]))
            if len(applied) == STEPS:
                break


def _check_one_skip_everywhere(results):
    for r in results:
        assert r["applied"][BAD_STEP] is False, r["applied"]
        assert all(r["applied"][:BAD_STEP]) and all(r["applied"][BAD_STEP + 1:]), r["applied"]
        assert math.isfinite(r["loss"])
    for step in range(STEPS):
        for other in results[1:]:
            assert torch.equal(results[0]["params"][step], other["params"][step]), step


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_a_gradient_changed_on_one_rank_after_backward_skips_the_step_on_every_rank(sharding):
    """ZeRO-1's step is collective (a rank skipping alone hung the others in its broadcast); under FSDP2,
    once the last backward finished the gradients, an inf written after it was applied, silently."""
    _check_one_skip_everywhere(run_ranks(_train, 3, sharding, "none", "edit", timeout=90))


def test_a_gradient_changed_on_one_rank_after_ddps_all_reduce_stops_the_job_at_the_next_step():
    """Under DDP each rank judges its own copy of the all-reduced gradients: one rank skipped the step, the
    others applied it, and the copies of the model (and fp16 loss scales) differed from then on, silently."""
    results = run_ranks(_train, 3, "none", "none", "edit", timeout=90)
    for r in results:
        assert r["applied"][BAD_STEP - 1] is True and len(r["applied"]) == BAD_STEP + 1, r["applied"]
        assert "1 of 3 ranks skipped the last step" in r["error"] and "restart from the last checkpoint" in r["error"]


@pytest.mark.parametrize("compression", ["int8", "topk", "powersgd"])
def test_an_overflow_under_compression_skips_one_step_and_the_rest_train(compression):
    results = run_ranks(_train, 3, "none", compression, "overflow")
    _check_one_skip_everywhere(results)
    clean = run_ranks(_train, 3, "none", compression, "none")
    assert all(clean[0]["applied"])
    # every rank's samples still reach the weights after the overflow: the run ends where the clean one does
    assert abs(results[0]["loss"] - clean[0]["loss"]) < 0.1 * clean[0]["loss"], (results[0]["loss"], clean[0]["loss"])
    assert results[0]["loss"] < full_loss(make_model())


def _raises_after_the_loop(rank, world):
    import hetrain

    try:
        with hetrain.Session(_plan("none", "none")) as session:
            net = make_model()
            model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for x, y in session.loader(make_data(), global_batch_size=GLOBAL):
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                if session.step_count == 3:
                    break
            if rank == 0:
                raise OSError("disk full while writing rank 0's report")
    except OSError:
        return "raised"
    except RuntimeError as e:   # the closing barrier, which the failing rank no longer joins
        return "peer gone" if "closed by peer" in str(e) or "Connection" in str(e) else str(e)
    return "closed"


def test_a_rank_leaving_the_session_on_an_error_does_not_hang_the_others_at_close():
    """A rank leaving on an error leaves at once (the others may be inside a step it would never join): it
    saves no final checkpoint and skips the closing barrier; the others end too, at theirs."""
    results = run_ranks(_raises_after_the_loop, 3, timeout=60)
    assert results[0] == "raised" and all(r in ("closed", "peer gone") for r in results[1:]), results
