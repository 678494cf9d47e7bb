"""ZeRO-1: torch's ZeroRedundancyOptimizer over the user's optimizer, even or by per-rank weights.

Imported only when a plan shards the optimizer state (`zero1`, `zero1-proportional`): torch's
ZeroRedundancyOptimizer module brings FSDP and DTensor with it, over a second of start-up per rank
that a job without ZeRO-1 does not pay. `ProportionalZeroRedundancyOptimizer` changes only the
partition (sharding.proportional_partition) and leaves everything else to torch: the local
optimizer, the broadcasts after each step, state dicts.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

with warnings.catch_warnings():   # torch's own module scripts functions with torch.jit, which torch deprecates:
    warnings.simplefilter("ignore", DeprecationWarning)   # nothing a script can act on, an error under -W error
    from torch.distributed.optim import ZeroRedundancyOptimizer

from hetrain.errors import HetrainError
from hetrain.runtime.sharding import check_fresh, constructor_settings, param_groups_for, proportional_partition
from hetrain.runtime.step_guard import stepped_parameters


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
        all_params = stepped_parameters(self)
        owner = dict(zip(map(id, all_params), proportional_partition([p.numel() for p in all_params], self._weights)))
        for group in self.param_groups:
            per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
            for p in group["params"]:
                per_rank[owner[id(p)]].append(p)
            self._partition_param_group(group, per_rank)
        return self._partition_parameters_cache


def zero1_optimizer(optimizer: torch.optim.Optimizer, weights: Sequence[float] | None = None) -> ZeroRedundancyOptimizer:
    """The user's optimizer (class, groups, hyper-parameters) as ZeRO-1: even, or by `weights`."""
    check_fresh(optimizer, "zero1")
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in stepped_parameters(optimizer)})
    if len(dtypes) > 1:   # torch's ZeroRedundancyOptimizer flattens them together, frozen ones too
        raise HetrainError(
            f"sharding 'zero1' shards every parameter the optimizer holds, frozen ones included, in one dtype, and "
            f"they are {', '.join(dtypes)}: build the optimizer on the trainable parameters "
            "([p for p in model.parameters() if p.requires_grad]), or use sharding 'none'")
    groups = param_groups_for(optimizer)
    cls = type(optimizer)
    if weights is None:
        sharded = ZeroRedundancyOptimizer(groups, cls, **constructor_settings(optimizer))
    else:
        sharded = ProportionalZeroRedundancyOptimizer(groups, cls, weights=weights, **constructor_settings(optimizer))
    if optimizer.state:   # loaded before session.prepare() (a run continued from before hetrain): each rank its part
        load_zero1_state(sharded, optimizer.state_dict())
        optimizer.state.clear()   # the whole state, which the step guard's hold on this optimizer would keep
    return sharded


def load_zero1_state(optimizer: ZeroRedundancyOptimizer, state: dict) -> None:
    """A full optimizer state dict loaded into ZeRO-1: this rank's part into its local optimizer. torch's load also
    gives the wrapper's own `state` a copy of that part (made apart from the local one on a GPU), which nothing
    reads (its state_dict() is built from the local optimizers'): it is let go."""
    optimizer.load_state_dict(state)
    optimizer.state.clear()
