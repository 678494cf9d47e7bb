"""ZeRO-1 (even and by free memory) and FSDP2: sharded state, the unsharded update, exact gradients."""

import torch

from hetrain.planning.plan import BalancePlan, Plan, RankPlan
from hetrain.runtime.data import GlobalBatchOrder
from hetrain.runtime.sharding import proportional_partition
from tests.distributed import run_ranks
from tests.memory.models import make_data, make_model

GiB = 2**30
CAPACITY = [3 * GiB, 2 * GiB, 1 * GiB]
SHARES = [6, 4, 2]
STEPS = 3


def test_proportional_partition_follows_weights():
    sizes = [100] * 12 + [10] * 6
    owner = proportional_partition(sizes, [3, 2, 1])
    load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert load == [630, 420, 210]


def _zero(rank, world):
    import torch.distributed as dist

    import hetrain
    from hetrain.runtime.sharding import optimizer_state_bytes

    dist.init_process_group("gloo")  # one group for the three sessions below
    out = {}
    for sharding in ("none", "zero1", "zero1-proportional"):
        plan = Plan(global_batch_size=sum(SHARES), sharding=sharding, balance=BalancePlan(enabled=False),
                    ranks=[RankPlan(rank=r, share=s, memory_capacity_bytes=c)
                           for r, (s, c) in enumerate(zip(SHARES, CAPACITY))])
        session = hetrain.Session(plan)
        net = make_model(depth=12)
        model, optimizer = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        loader = session.loader(make_data(), global_batch_size=sum(SHARES), shuffle=True, seed=2)
        for step, (x, y) in enumerate(loader):
            if step == STEPS:
                break
            session.backward(torch.nn.functional.cross_entropy(model(x), y))
            session.step()
        out[sharding] = {"bytes": optimizer_state_bytes(optimizer),
                         "params": [p.detach().clone() for p in net.parameters()],
                         "kind": type(optimizer).__name__}
    return out


def test_zero1_shards_state_evenly_or_by_memory_and_keeps_the_update():
    results = run_ranks(_zero, 3)
    total = results[0]["none"]["bytes"]
    assert all(r["none"]["bytes"] == total for r in results)
    weights = [c - 2 * 4 * sum(p.numel() for p in make_model(depth=12).parameters()) for c in CAPACITY]
    for sharding, targets in (("zero1", [1 / 3] * 3), ("zero1-proportional", [w / sum(weights) for w in weights])):
        got = [r[sharding]["bytes"] for r in results]
        assert sum(got) == total, (sharding, got, total)
        for rank in range(3):
            assert abs(got[rank] - targets[rank] * total) <= 0.10 * targets[rank] * total, (sharding, got, total)
            for a, b in zip(results[rank][sharding]["params"], results[rank]["none"]["params"]):
                assert (a - b).abs().max().item() < 1e-5, sharding
    assert results[0]["zero1-proportional"]["kind"] == "ProportionalZeroRedundancyOptimizer"


def _fsdp(rank, world, splits):
    import hetrain

    plan = Plan(global_batch_size=sum(splits[0]), sharding="fsdp", balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s, activation_checkpointing=(r == 0)) for r, s in enumerate(splits[0])])
    session = hetrain.Session(plan)
    net = make_model()
    model, optimizer = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=sum(splits[0]), shuffle=True, seed=3)
    grads, params = [], []
    for step, (x, y) in enumerate(loader):
        if step == len(splits):
            break
        loss = torch.nn.functional.cross_entropy(model(x), y)
        session.backward(loss)
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        session.step()
        params.append([p.full_tensor().detach() for p in model.parameters()])
        session.balancer.shares = list(splits[(step + 1) % len(splits)])
    return {"grads": grads, "params": params, "blocks": len(session.blocks)}


def test_fsdp_gradients_equal_the_global_batch_gradient_under_uneven_shares():
    splits = [[5, 2, 1], [0, 3, 5]]
    results = run_ranks(_fsdp, 3, splits)
    order = GlobalBatchOrder(len(make_data()), 8, shuffle=True, seed=3)
    reference = make_model()
    for step in range(len(splits)):
        want = global_grads_for(reference, order.global_batch(0, step))
        for rank in range(3):
            for got, ref in zip(results[rank]["grads"][step], want):
                assert (got - ref).abs().max().item() < 1e-5, (step, rank)
        with torch.no_grad():
            for p, g in zip(reference.parameters(), want):
                p -= 0.1 * g
        for rank in range(3):
            for got, ref in zip(results[rank]["params"][step], reference.parameters()):
                assert (got - ref).abs().max().item() < 1e-5, (step, rank)
    assert results[0]["blocks"] == 6


def global_grads_for(model, indices):
    x, y = make_data()[indices]
    return torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), list(model.parameters()))


def test_a_session_imports_torch_s_zero_pipelining_and_checkpoint_modules_only_when_needed():
    """Every rank imports hetrain.runtime.session; torch's ZeRO (with FSDP and DTensor), pipelining and
    DCP modules add over a second to its start-up and come only with a plan or checkpoint that needs them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import hetrain.runtime.session\n"
        "heavy = ('torch.distributed.optim', 'torch.distributed.pipelining', 'torch.distributed.checkpoint')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "from hetrain.runtime.zero1 import ProportionalZeroRedundancyOptimizer, zero1_optimizer\n"
        "print(ProportionalZeroRedundancyOptimizer.__module__, 'torch.distributed.optim' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "hetrain.runtime.zero1 True"], out.stdout


class _ScaledSGD(torch.optim.SGD):
    """A user's optimizer that keeps a setting of its own outside `defaults`, and one it derives (a count,
    smaller on a rank's shard: not a setting)."""

    def __init__(self, params, lr=0.1, scale=0.5):
        super().__init__(params, lr=lr)
        self.scale = scale
        self.num_params = sum(len(g["params"]) for g in self.param_groups)


class _KeywordSGD(torch.optim.SGD):
    """One that takes its own setting through **kwargs, under another name."""

    def __init__(self, params, lr=0.1, **options):
        super().__init__(params, lr=lr)
        self.factor = options.get("scale", 0.5)


def _rebuilt(rank, world, sharding, kind):
    import hetrain

    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate([5, 3])])
    session = hetrain.Session(plan)
    net = make_model()
    optimizer = (_ScaledSGD(net.parameters(), lr=0.1, scale=0.25) if kind == "scaled" else
                 _KeywordSGD(net.parameters(), lr=0.1, scale=0.25) if kind == "keyword" else
                 _ScaledSGD(net.parameters(), lr=0.1) if kind == "counting" else
                 torch.optim.Adagrad(net.parameters(), lr=0.1))   # Adagrad builds its state at once
    try:
        model, _ = session.prepare(net, optimizer)
    except hetrain.HetrainError as e:
        session.close()
        return str(e)
    for step, (x, y) in enumerate(session.loader(make_data(), global_batch_size=8, shuffle=False)):
        session.backward(torch.nn.functional.cross_entropy(model(x), y))
        session.step()
        if step == 2:
            break
    state = session.model_state_dict()
    session.close()
    return state


def test_an_optimizer_re_created_by_sharding_keeps_its_settings_or_is_refused():
    """A setting kept outside `defaults` was silently reset when ZeRO-1 or FSDP2 re-created the optimizer
    (scale 0.25 trained as 0.5); Adagrad, whose constructor makes its state, was refused as used."""
    for sharding in ("zero1", "fsdp"):
        errors = run_ranks(_rebuilt, 2, sharding, "scaled")
        assert all("_ScaledSGD keeps 'scale' outside its defaults (0.25 here, 0.5 in" in e for e in errors), errors
        assert not any(isinstance(out, str) for out in run_ranks(_rebuilt, 2, sharding, "counting"))   # no refusal
        errors = run_ranks(_rebuilt, 2, sharding, "keyword")
        assert all("_KeywordSGD keeps 'factor' outside its defaults (0.25 here, 0.5 in" in e for e in errors), errors
        got = run_ranks(_rebuilt, 2, sharding, "adagrad")[0]
        net = make_model()
        opt = torch.optim.Adagrad(net.parameters(), lr=0.1)
        x, y = make_data().tensors
        for step in range(3):
            torch.nn.functional.cross_entropy(net(x[step * 8:(step + 1) * 8]), y[step * 8:(step + 1) * 8]).backward()
            opt.step()
            opt.zero_grad()
        for name, p in net.state_dict().items():
            torch.testing.assert_close(got[name], p, rtol=0, atol=1e-5)   # Adagrad divides by small sums


def _groups(net):
    """Two parameter groups as a fine-tuning script builds them: no weight decay on biases and norms."""
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in net.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _earlier_run():
    """A run before hetrain, in one process: 3 AdamW steps on other samples; its model and optimizer state, as
    a DDP script saves them."""
    net = make_model()
    opt = torch.optim.AdamW(_groups(net), lr=1e-2)
    x, y = make_data().tensors
    for step in range(3):
        torch.nn.functional.cross_entropy(net(-x[step * 8:(step + 1) * 8]), y[step * 8:(step + 1) * 8]).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _continued(rank, world, sharding, saved):
    import io

    import hetrain

    saved = torch.load(io.BytesIO(saved))
    plan = Plan(global_batch_size=8, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=s) for r, s in enumerate([5, 3])])
    session = hetrain.Session(plan)
    net = make_model()
    net.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(_groups(net), lr=1e-2)
    optimizer.load_state_dict(saved["optimizer"])   # before prepare, as the ported script loads its checkpoint
    model, sharded = session.prepare(net, optimizer)
    assert not optimizer.state, "the whole loaded state stays on every rank beside its shard"
    assert sharding == "fsdp" or not sharded.state, "ZeRO-1's wrapper keeps a copy of this rank's part"
    for step, (x, y) in enumerate(session.loader(make_data(), global_batch_size=8, shuffle=False)):
        session.backward(torch.nn.functional.cross_entropy(model(x), y))
        session.step()
        if step == 1:
            break
    state = session.model_state_dict()
    session.close()
    return state


def test_optimizer_state_loaded_before_prepare_carries_into_the_sharded_optimizer():
    """A run continued from a DDP checkpoint: its Adam moments, loaded before session.prepare(), were refused
    under ZeRO-1 and FSDP2 ('already holds state'), with a fix (the session's checkpoints) such a run has not."""
    import io

    net, opt = _earlier_run()
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, buf)
    fresh = make_model()
    fresh.load_state_dict(net.state_dict())
    fresh_opt = torch.optim.AdamW(_groups(fresh), lr=1e-2)
    x, y = make_data().tensors
    for step in range(2):   # the reference: the same run continued in one process, on the whole global batches
        for model, optimizer in ((net, opt), (fresh, fresh_opt)):
            torch.nn.functional.cross_entropy(model(x[step * 8:(step + 1) * 8]), y[step * 8:(step + 1) * 8]).backward()
            optimizer.step()
            optimizer.zero_grad()
    for sharding in ("zero1", "fsdp"):
        got = run_ranks(_continued, 2, sharding, buf.getvalue())[0]
        for name, p in net.state_dict().items():
            torch.testing.assert_close(got[name], p, rtol=0, atol=1e-6, msg=f"{sharding} {name}")
        assert any((got[n] - p).abs().max() > 1e-4 for n, p in fresh.state_dict().items())   # the moments counted


class _Factored(torch.optim.SGD):
    """An optimizer whose state is not of its parameters' shapes (factored second moments, as Adafactor keeps)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("row", torch.zeros(p.shape[0]))
        return super().step(closure)


def _factored(rank, world):
    import hetrain

    plan = Plan(global_batch_size=8, sharding="fsdp", balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=0, share=8)])
    session = hetrain.Session(plan)
    net = make_model()
    optimizer = _Factored(net.parameters(), lr=0.1)
    net(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    try:
        session.prepare(net, optimizer)
    except hetrain.HetrainError as e:
        assert len(optimizer.state) == len(list(net.parameters())), "refused, and the optimizer was left without state"
        return str(e)
    finally:
        session.close()


def test_state_fsdp2_cannot_cut_as_its_parameter_is_named():
    said = run_ranks(_factored, 1)[0]
    assert said is not None and "state 'row' of embed.weight has shape (16,), not its parameter's (16, 6)" in said, said
    assert "sharding 'zero1' or 'none'" in said


def test_a_scheduler_is_told_from_param_groups_a_checkpoint_loaded():
    """The param groups of a checkpoint whose run had a scheduler carry `initial_lr`: that was refused as 'an LR
    scheduler was built on this optimizer before session.prepare()' though none was."""
    import pytest

    from hetrain.errors import HetrainError
    from hetrain.runtime.sharding import check_fresh

    net, opt = _earlier_run()
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    loaded = torch.optim.AdamW(_groups(make_model()), lr=1e-2)
    loaded.load_state_dict(opt.state_dict())
    assert all("initial_lr" in group for group in loaded.param_groups)
    check_fresh(loaded, "zero1")
    with pytest.raises(HetrainError, match="LR scheduler was built on this optimizer before session.prepare"):
        check_fresh(opt, "zero1")


def _shard_without_blocks(rank, world):
    import logging

    import torch.distributed as dist

    from hetrain.runtime.sharding import fully_shard_model

    dist.init_process_group("gloo")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("hetrain").addHandler(handler)
    fully_shard_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), [])
    model = make_model()
    fully_shard_model(model, list(model.layers))   # one group a block: nothing to say
    return seen


def test_fsdp2_over_a_model_without_blocks_says_it_gathers_the_whole_model_at_once():
    seen = run_ranks(_shard_without_blocks, 1)[0]
    assert len(seen) == 1 and "gathers all its weights at once" in seen[0] and "blocks=[...]" in seen[0], seen


def test_a_zero1_plan_runs_where_warnings_are_errors():
    """A script (or its pytest) under `-W error`: torch's own ZeRO module emits torch.jit's deprecation as it is
    imported, which then failed every ZeRO-1 plan's prepare() on every rank, while DDP and FSDP2 plans ran."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-W", "error", "-c", "import hetrain.runtime.zero1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
