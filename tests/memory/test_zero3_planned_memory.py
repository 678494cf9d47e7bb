"""The planner's ZeRO-3 memory against the bytes an FSDP2 rank holds, counted tensor by tensor on CPU ranks."""

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks

WIDTH, DEPTH, BATCH = 256, 6, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(DEPTH)])


def _peak_bytes(rank, world, ckpt):
    """Peak bytes of live tensors (every op's output, by storage, at its size then: FSDP2 frees a gathered block
    by resizing its storage to 0) in the second of two micro-batches, beside the first's gradient shards, of the
    runtime's FSDP2 model under its bf16 autocast."""
    import weakref

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from hetrain.runtime import memory, precision, sharding

    dist.init_process_group("gloo")
    net = make_model()
    blocks = memory.apply_activation_checkpointing(net) if ckpt else memory.resolve_blocks(net, None)
    sharding.fully_shard_model(net, blocks)
    live: dict[int, list] = {}

    def track(t: torch.Tensor) -> None:
        live.setdefault(t.untyped_storage().data_ptr(), []).append(weakref.ref(t))

    def held() -> int:
        return sum(max((t.untyped_storage().nbytes() for t in map(lambda r: r(), refs) if t is not None), default=0)
                   for refs in live.values())

    for p in net.parameters():
        track(p._local_tensor)
    peak = [0]

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    track(t)
            peak[0] = max(peak[0], held())
            return out

    x = torch.randn(BATCH, WIDTH)
    for _ in range(2):
        peak[0] = 0
        with Live():
            with precision.autocast("bf16", torch.device("cpu"), sharding="fsdp"):
                loss = net(x).float().pow(2).mean()
            loss.backward()
    return peak[0]


@pytest.mark.parametrize("ckpt", [False, True])
def test_planned_zero3_memory_holds_what_an_fsdp2_rank_holds(ckpt):
    """The fp32 shard, two gathered blocks, a block's unsharded gradients and their reduce-scatter input, the
    gradient shards, and 16-bit casts (of every weight without checkpointing, of the gathered blocks with it):
    planned 1.02-1.08x of the peak this test measures on 2 ranks (a review measured 1.04-1.08x on 4). Before,
    the plan fell under the peak (a 16-bit shard counted in place of the casts, no unsharded gradients)."""
    from hetrain.planning import cost_model as cm
    from hetrain.workload.profile import profile

    prof = profile(make_model(), torch.randn(1, WIDTH))
    peaks = run_ranks(_peak_bytes, 2, ckpt)
    est = cm.memory_estimate(prof, "bf16", BATCH, optimizer="sgd-nomomentum", zero=3, world=2, checkpointing=ckpt)
    planned = est.weights + est.gradients + est.activations + est.weight_casts
    for measured in peaks:
        assert measured <= planned <= 1.15 * measured, (ckpt, planned, measured)
