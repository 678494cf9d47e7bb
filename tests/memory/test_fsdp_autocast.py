"""FSDP2 under 16-bit autocast: the 16-bit casts of the gathered weights live only as long as backward needs them."""

import torch

from tests.distributed import run_ranks
from tests.memory.models import make_data, make_model

WIDTH, DEPTH = 32, 6


def _casts_alive(rank, world, ckpt):
    """(peak bytes of 16-bit weight casts alive, per-parameter full gradients) of one forward and backward
    of the runtime's FSDP2 model (activation checkpointing as asked) under precision.autocast with the
    sharding "fsdp" and, for comparison, "none"."""
    import weakref

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from hetrain.runtime import memory, precision, sharding

    dist.init_process_group("gloo")
    weight_sizes = {p.numel() for p in make_model(WIDTH, DEPTH).parameters()}
    x, y = make_data(8).tensors
    out = {}
    for name in ("fsdp", "none"):
        net = make_model(WIDTH, DEPTH)
        blocks = memory.apply_activation_checkpointing(net) if ckpt else memory.resolve_blocks(net, None)
        sharding.fully_shard_model(net, blocks)
        live, peak = [], [0]

        class Casts(TorchDispatchMode):
            """Weak references to autocast's bf16 casts of weights: alive while anything (its cache,
            autograd) holds them."""

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                if (func is torch.ops.aten._to_copy.default and result.dtype == torch.bfloat16
                        and isinstance(args[0], torch.nn.Parameter) and args[0].numel() in weight_sizes):
                    live.append((weakref.ref(result), result.numel() * 2))
                peak[0] = max(peak[0], sum(n for ref, n in live if ref() is not None))
                return result

        with Casts():
            with precision.autocast("bf16", torch.device("cpu"), sharding=name):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
        out[name] = (peak[0], [p.grad.full_tensor() for p in net.parameters()])
    return out


def test_fsdp_autocast_keeps_no_cast_of_the_whole_model_under_checkpointing():
    """With activation checkpointing, autocast's weight cache held a bf16 copy of every block until the forward
    ended (all 6 blocks' weights on each of 2 ranks); without it only the block being recomputed has one.
    The gradients are the same bits."""
    model = make_model(WIDTH, DEPTH)
    whole = 2 * sum(p.numel() for p in model.parameters())
    block = 2 * sum(p.numel() for p in model.layers[0].parameters())
    for rank, result in enumerate(run_ranks(_casts_alive, 2, True)):
        (sharded, grads), (cached, reference) = result["fsdp"], result["none"]
        assert cached >= 0.95 * whole, (rank, cached, whole)   # the measurement sees the cache
        assert sharded <= block, (rank, sharded, block)
        assert all(torch.equal(a, b) for a, b in zip(grads, reference))


def test_fsdp_autocast_without_checkpointing_keeps_the_casts_backward_needs():
    """Without checkpointing the ops save the casts for backward, cache or not: the planner counts 2 bytes a
    parameter of the whole model for them (cost_model.state_bytes)."""
    whole = 2 * sum(p.numel() for p in make_model(WIDTH, DEPTH).parameters())
    for result in run_ranks(_casts_alive, 2, False):
        assert result["fsdp"][0] >= 0.9 * whole and result["none"][0] >= 0.9 * whole, (result["fsdp"][0], whole)


def _session_caches(rank, world, sharding):
    import hetrain
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=4, sharding=sharding, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=2, precision="bf16") for r in range(world)])
    session = hetrain.Session(plan)
    net = make_model(WIDTH, DEPTH)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with session.autocast():
        cached = torch.is_autocast_cache_enabled()
    session.close()
    return cached


def test_the_sessions_autocast_under_fsdp_keeps_no_weight_cache_and_elsewhere_keeps_it():
    assert run_ranks(_session_caches, 2, "fsdp") == [False, False]
    assert run_ranks(_session_caches, 2, "none") == [True, True]
