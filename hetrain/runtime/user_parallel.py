"""Parallelism a script put on its model itself, which hetrain's plan would apply a second time.

hetrain wraps the bare model for its plan (DDP, ZeRO-1, FSDP2). A model already wrapped, one whose modules went
through torch's composable `replicate()` or `fully_shard()`, one with tensor-parallel (DTensor) parameters, or a
`DistributedDataParallel` the script puts around the model `prepare()` returned would have its gradients reduced
twice: averaged over the ranks twice, the update is a fraction of the right one, with no error.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetrain.errors import HetrainError


def check_bare_model(model: nn.Module) -> None:
    """Refuses, in one line naming the fix, a model the script parallelized itself."""
    fsdp = sys.modules.get("torch.distributed.fsdp")   # loaded where a script wrapped the model in it
    wrappers = (DistributedDataParallel,) + ((fsdp.FSDPModule, fsdp.FullyShardedDataParallel) if fsdp else ())
    if isinstance(model, wrappers):
        bare = "model.module" if isinstance(model, DistributedDataParallel) else "the model before fully_shard()"
        raise HetrainError(
            f"session.prepare() was given a model already wrapped in {type(model).__name__}: its gradients would "
            f"be reduced twice; pass the bare model ({bare}), hetrain wraps it for the plan")
    for name, module in model.named_modules():
        applied = sorted(_composable(module))
        if applied:
            what = f"a model whose module {name!r}" if name else "a model that"
            raise HetrainError(
                f"session.prepare() was given {what} went through {' and '.join(applied)}(): its "
                "gradients would be reduced twice; pass the model before that call, hetrain applies the plan's "
                "data parallelism (DDP, ZeRO-1 or FSDP2: the plan's sharding) itself")
    dtensors = [n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"
                or type(getattr(p, "data", None)).__name__ == "DTensor"]
    if dtensors:
        raise HetrainError(
            f"session.prepare() was given a model with DTensor parameters ({dtensors[0]}, ...: tensor parallelism, "
            "or a module sharded by the script): hetrain runs data parallelism over whole models and does not "
            "combine its plans with tensor parallelism; pass the model before parallelize_module()/fully_shard()")


def _composable(module: nn.Module) -> set[str]:
    """The data-parallel composable APIs applied to this module (torch's registry; `checkpoint` is no such)."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:   # pragma: no cover - a torch without composable APIs
        return set()
    return set(_get_registry(module) or ()) & {"replicate", "fully_shard"}


def refuse_outer_wrapper(ddp: DistributedDataParallel) -> Any:
    """A forward pre-hook on hetrain's DDP: a DistributedDataParallel of the script's around the model prepare()
    returned runs its forward inside that wrapper's (torch marks the running one), and its reducer would average
    the gradients hetrain's already averaged."""
    def hook(module: nn.Module, _args: Any) -> None:
        outer = DistributedDataParallel._active_ddp_module
        if outer is not None and outer is not module:
            raise HetrainError(
                "the model session.prepare() returned was wrapped in a DistributedDataParallel of the script's (or "
                "ran inside another session's model's forward): its gradients would be averaged over the ranks "
                "twice; use the returned model as it is (it is already data parallel), and keep DDP(...) out of the "
                "script")
    return ddp.register_forward_pre_hook(hook)
