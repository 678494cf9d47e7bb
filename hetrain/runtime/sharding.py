"""Sharded optimizer state and parameters: ZeRO-1 (even or by free memory) and FSDP2, from the plan.

ZeRO-1 is torch's ZeroRedundancyOptimizer. Its own partition balances parameter sizes evenly;
`ProportionalZeroRedundancyOptimizer` gives it an uneven partition instead (each rank's share of
parameters, hence of optimizer state, in proportion to a weight such as its free memory) and
leaves everything else to torch: the local optimizer, the broadcasts after each step, state dicts.
FSDP2 is `fully_shard` on each block, then on the root. Gradients stay exact under uneven shares
because the loss weighting (`local_n * world / global_n`) is the same whatever reduces them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from hetrain.errors import HetrainError

log = logging.getLogger("hetrain")



def proportional_partition(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Owner rank of each parameter: largest first, each to the rank least filled relative to its weight."""
    if not weights or any(w <= 0 for w in weights):
        raise HetrainError(f"proportional sharding needs a positive weight per rank, got {list(weights)}")
    loads = [0.0] * len(weights)
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(len(weights)), key=lambda r: ((loads[r] + sizes[i]) / weights[r], r))
        owner[i] = rank
        loads[rank] += sizes[i]
    return owner


class ProportionalZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer whose partition follows per-rank weights instead of an even balance."""

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer], *, weights: Sequence[float],
                 process_group: Any | None = None, **defaults: Any) -> None:
        self._weights = [float(w) for w in weights]
        super().__init__(params, optimizer_class, process_group=process_group, **defaults)

    def _partition_parameters(self, params_per_rank: list[list[torch.Tensor]] | None = None) -> list[list[dict]]:
        if params_per_rank is not None or self._partition_parameters_cache:
            return super()._partition_parameters(params_per_rank)
        if len(self._weights) != self.world_size:
            raise HetrainError(f"{len(self._weights)} sharding weights for {self.world_size} ranks; give one per rank")
        # Same shape of cache torch builds: per rank, one group per parameter group (maybe empty).
        self._partition_parameters_cache = [[] for _ in range(self.world_size)]
        all_params = [p for g in self.param_groups for p in g["params"]]
        owner = dict(zip(map(id, all_params), proportional_partition([p.numel() for p in all_params], self._weights)))
        for group in self.param_groups:
            per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
            for p in group["params"]:
                per_rank[owner[id(p)]].append(p)
            self._partition_param_group(group, per_rank)
        return self._partition_parameters_cache


def _param_groups_for(optimizer: torch.optim.Optimizer, params_by_id: dict[int, nn.Parameter] | None = None
                      ) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        ps = group["params"]
        g["params"] = [params_by_id[id(p)] for p in ps] if params_by_id is not None else list(ps)
        groups.append(g)
    return groups


def constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor takes (AdamW keeps one it does not)."""
    import inspect

    accepted = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _check_fresh(optimizer: torch.optim.Optimizer, sharding: str) -> None:
    if optimizer.state:
        raise HetrainError(
            f"the optimizer already holds state, which sharding {sharding!r} would drop; pass a freshly built "
            "optimizer to session.prepare() and load optimizer state through the session's checkpoints"
        )


def zero1_optimizer(optimizer: torch.optim.Optimizer, weights: Sequence[float] | None = None) -> ZeroRedundancyOptimizer:
    """The user's optimizer (class, groups, hyper-parameters) as ZeRO-1: even, or by `weights`."""
    _check_fresh(optimizer, "zero1")
    groups = _param_groups_for(optimizer)
    cls = type(optimizer)
    if weights is None:
        return ZeroRedundancyOptimizer(groups, cls, **constructor_settings(optimizer))
    return ProportionalZeroRedundancyOptimizer(groups, cls, weights=weights, **constructor_settings(optimizer))


def free_memory_weights(capacities: Sequence[int | None], model: nn.Module, device: torch.device) -> list[float]:
    """Bytes each rank has left for optimizer state: capacity (plan) or free device memory (measured),
    less the fp32 weights and gradients every rank holds alike."""
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    if all(c is not None for c in capacities):
        free = [float(c) for c in capacities]
    elif device.type == "cuda":
        mine = torch.tensor([float(torch.cuda.mem_get_info(device)[0])], dtype=torch.float64, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        free = [float(t.item()) for t in everyone]
        state //= 2  # the weights are already on the device, counted in what is not free
    else:
        raise HetrainError(
            "sharding 'zero1-proportional' needs each rank's memory: set memory_capacity_bytes on every rank of "
            "the plan (hetrain plan writes it), run on CUDA devices, or use sharding 'zero1'"
        )
    left = [f - state for f in free]
    if min(left) <= 0:
        worst = left.index(min(left))
        raise HetrainError(
            f"rank {worst} has {free[worst] / 2**30:.1f} GiB, less than the model's fp32 weights and gradients "
            f"({state / 2**30:.1f} GiB); use sharding 'fsdp' or a device with more memory"
        )
    return left


def fully_shard_model(model: nn.Module, blocks: Sequence[nn.Module], *, offload: bool = False) -> nn.Module:
    """FSDP2: each block its own shard group, then the root; parameters stay fp32 (autocast computes)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module
                      ) -> torch.optim.Optimizer:
    """The user's optimizer re-created over the model's new (sharded) parameters, matched by name."""
    _check_fresh(optimizer, "fsdp")
    by_name = dict(model.named_parameters())
    missing = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]
               if names.get(id(p)) not in by_name]
    if missing:
        raise HetrainError(
            f"optimizer parameters {missing[:3]} are not parameters of the model; build the optimizer from "
            "model.parameters() before session.prepare()"
        )
    new_by_old = {pid: by_name[name] for pid, name in names.items() if name in by_name}
    return type(optimizer)(_param_groups_for(optimizer, new_by_old), **constructor_settings(optimizer))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard under ZeRO-1 and FSDP2)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    total = 0
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value = value.to_local() if hasattr(value, "to_local") else value
                total += value.numel() * value.element_size()
    return total
