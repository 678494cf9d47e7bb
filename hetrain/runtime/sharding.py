"""Sharded optimizer state and parameters: ZeRO-1 (even or by free memory) and FSDP2, from the plan.

ZeRO-1 is torch's ZeroRedundancyOptimizer, built in hetrain.runtime.zero1 (imported only when a
plan asks for it): even, or with the uneven partition `proportional_partition` computes (each rank's
share of parameters, hence of optimizer state, in proportion to a weight such as its free memory).
FSDP2 is `fully_shard` on each block, then on the root. Gradients stay exact under uneven shares
because the loss weighting (hetrain.runtime.step_state) is the same whatever reduces them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetrain.errors import HetrainError
from hetrain.runtime.batch_tree import plain_values
from hetrain.runtime.gradients import local_tensor
from hetrain.runtime.step_guard import stepped_parameters

log = logging.getLogger("hetrain")


def is_zero1(optimizer: Any) -> bool:
    """Whether `optimizer` is torch's ZeroRedundancyOptimizer. Its module (which brings FSDP and DTensor
    with it) is imported only when a ZeRO-1 plan is applied (hetrain.runtime.zero1), so a job without
    ZeRO-1 does not pay for the import; an optimizer of that class cannot exist before it."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


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


def param_groups_for(optimizer: torch.optim.Optimizer, params_by_id: dict[int, nn.Parameter] | None = None
                     ) -> list[dict[str, Any]]:
    """The optimizer's parameter groups (settings and parameters), with each parameter replaced by
    `params_by_id[id(p)]` when given (the model's new, sharded parameters)."""
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


_TORCH_OPTIMIZER_ATTRIBUTES = frozenset(vars(torch.optim.SGD([torch.zeros(1, requires_grad=True)])))


def check_rebuilt_alike(old: torch.optim.Optimizer, sharding: str) -> None:
    """The optimizer sharding re-creates from its class, parameter groups and defaults keeps every plain
    setting of the user's (numbers, strings, flags): a class that keeps one outside its `defaults`
    (`self.scale = scale`, or through **kwargs) was re-created with the constructor's default, silently.
    Compared with a re-creation over the same groups, unsharded, so what the instance derives from its
    parameters (a count) agrees."""
    again = type(old)(param_groups_for(old), **constructor_settings(old))
    new_vars = vars(again)
    for name, value in vars(old).items():
        if name.startswith("_") or name in _TORCH_OPTIMIZER_ATTRIBUTES or not plain_values(value):
            continue
        if name not in new_vars or new_vars[name] != value:
            raise HetrainError(
                f"{type(old).__name__} keeps {name!r} outside its defaults ({value!r} here, "
                f"{new_vars.get(name, 'nothing')!r} in the optimizer sharding {sharding!r} re-creates from its "
                "parameter groups and defaults); pass it to Optimizer.__init__ in the defaults dict, so that "
                "param_groups carry it")


def check_fresh(optimizer: torch.optim.Optimizer, sharding: str) -> None:
    """An optimizer that sharding may re-create: no LR scheduler drives it, and it keeps no setting its
    re-creation would lose. The state it holds (a run continued from before hetrain) goes over to the new one:
    `carry_state`, and `load_zero1_state` in hetrain.runtime.zero1."""
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):   # what torch's LRScheduler wraps step with
        raise HetrainError(
            f"an LR scheduler was built on this optimizer before session.prepare(); sharding {sharding!r} "
            "re-creates the optimizer, so the scheduler would drive the old one and the learning rate would "
            "stay where it was built (0 at a warm-up's start); build the scheduler on the optimizer "
            "session.prepare() returns (its state, loaded from a checkpoint, with scheduler.load_state_dict)"
        )
    check_rebuilt_alike(optimizer, sharding)


def carry_state(old: torch.optim.Optimizer, new: torch.optim.Optimizer, new_by_old: dict[int, nn.Parameter],
                names: dict[int, str]) -> None:
    """The state `old` holds (loaded before session.prepare() from a run that began without hetrain) moved to `new`,
    whose parameters are FSDP2's shards of old's: each tensor of a parameter's shape cut as the parameter is (every
    rank holds the whole state, as it loaded it), the rest (Adam's step) as it is. `old` is left without state:
    each rank keeps its shards only. `new` may be `old` (a pipeline stage's optimizer, given its shards)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def cut(p: torch.Tensor, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and isinstance(new_by_old[id(p)], DTensor) and value.dim() > 0

    for p, state in old.state.items():   # refused before anything moves: the script's optimizer keeps its state
        for key, value in state.items():
            if cut(p, value) and value.shape != p.shape:
                raise HetrainError(
                    f"the optimizer's state {key!r} of {names.get(id(p), 'a parameter')} has shape "
                    f"{tuple(value.shape)}, not its parameter's {tuple(p.shape)}: FSDP2 shards the state of a "
                    "parameter's shape only; load it into the optimizer session.prepare() returns, or use "
                    "sharding 'zero1' or 'none'")
    held = list(old.state.items())
    old.state.clear()
    for p, state in held:
        shard = new_by_old[id(p)]
        carried = {}
        for key, value in state.items():
            if cut(p, value):
                whole = distribute_tensor(value.detach().to(shard.device_mesh.device_type), shard.device_mesh,
                                          shard.placements, src_data_rank=None)
                value = torch.zeros_like(shard, dtype=value.dtype)   # the parameter's placement and device
                value.to_local().copy_(whole.to_local())
            carried[key] = value
        new.state[shard] = carried
        state.clear()


def state_where_parameters_are(optimizer: torch.optim.Optimizer | None) -> None:
    """State loaded into the optimizer before session.prepare() moved the model to this rank's device, moved to its
    parameter's device in place (the script's param_groups and hooks untouched), by the rule torch's
    load_state_dict casts with: a step counter stays where it is unless the group is fused or capturable."""
    if optimizer is None or not optimizer.state:
        return
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p)
            for key, value in (state or {}).items():
                if isinstance(value, torch.Tensor) and value.device != p.device and (key != "step" or on_device):
                    state[key] = value.to(device=p.device)


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
    if not blocks:
        log.warning("FSDP2 shards %s as one group: it has no nn.ModuleList or nn.Sequential of repeated blocks, so "
                    "every forward gathers all its weights at once and the peak holds the whole model; pass "
                    "session.prepare(model, optimizer, blocks=[...]) to gather one block at a time",
                    type(model).__name__)
    hooked = [name for name, p in model.named_parameters()
              if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:   # FSDP2 computes gradients on its own sharded tensors: a hook on the parameter given never runs
        log.warning("FSDP2 runs no gradient hook registered on a parameter (register_hook, "
                    "register_post_accumulate_grad_hook), which these have: %s; change p.grad between the step's "
                    "last session.backward() and session.step() instead, or use sharding none or zero1 "
                    "(docs/porting.md)",
                    ", ".join(hooked[:3]) + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else ""))
    inside = {id(m) for block in blocks for m in block.modules()}
    outside = {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}
    for group in sharing_groups(blocks):   # blocks that share a weight (ALBERT's layers) gather it as one group
        if any(id(p) in outside for block in group for p in block.parameters()):   # shared with the model's own
            log.info("FSDP2 gathers %d block(s) with the model's own weights: they share a weight with them",
                     len(group))
            continue   # parts: sharded with the root, which holds it
        fully_shard(group if len(group) > 1 else group[0], offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model


def sharing_groups(blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """The blocks in groups joined by a parameter they share, in their order (each block alone where none)."""
    group_of: list[int] = list(range(len(blocks)))

    def root(i: int) -> int:
        while group_of[i] != i:
            i = group_of[i]
        return i

    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            j = owner.setdefault(id(p), i)
            group_of[root(i)] = root(j)
    groups: dict[int, list[nn.Module]] = {}
    for i, block in enumerate(blocks):
        groups.setdefault(root(i), []).append(block)
    return list(groups.values())


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module
                      ) -> torch.optim.Optimizer:
    """The user's optimizer re-created over the model's new (sharded) parameters, matched by name."""
    check_fresh(optimizer, "fsdp")
    by_name = dict(model.named_parameters())
    missing = [names.get(id(p), "?") for p in stepped_parameters(optimizer) if names.get(id(p)) not in by_name]
    if missing:
        raise HetrainError(
            f"optimizer parameters {missing[:3]} are not parameters of the model; build the optimizer from "
            "model.parameters() before session.prepare()"
        )
    new_by_old = {pid: by_name[name] for pid, name in names.items() if name in by_name}
    rebuilt = type(optimizer)(param_groups_for(optimizer, new_by_old), **constructor_settings(optimizer))
    carry_state(optimizer, rebuilt, new_by_old, names)
    return rebuilt


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard under ZeRO-1 and FSDP2)."""
    local = optimizer.optim if is_zero1(optimizer) else optimizer
    total = 0
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value = local_tensor(value)
                total += value.numel() * value.element_size()
    return total


