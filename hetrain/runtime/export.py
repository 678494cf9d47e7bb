"""`session.model_state_dict()`: the whole trained model, in one place, under any plan.

Under DDP and ZeRO-1 every rank holds the whole model and rank 0's copy is returned. FSDP2 shards
are gathered with torch's `get_model_state_dict(full_state_dict=True, cpu_offload=True)`, which
hands the result to rank 0. Under a pipeline each stage holds part of the blocks, under the whole
model's parameter names (as its checkpoints store them): the first replica's stages send their
parts to rank 0, which joins them. The names are those of the model passed to `session.prepare()`,
so `model.load_state_dict(state)` on a fresh copy of it (a Hugging Face model's blocks wrapper
under a pipeline) restores the trained weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.meeting import meet
from hetrain.runtime.watchdog import collective_call


def full_model_state(session: Any) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on rank 0 (CPU tensors), None on the other ranks (collective)."""
    if session.prepared is None:
        raise HetrainError("call session.prepare(model, optimizer) before session.model_state_dict()")
    if session.sharding == "fsdp" or session.pipeline is not None:
        # gathers a rank made alone (`if rank == 0:`) would pair with the others' step and abort the job in gloo:
        # the ranks meet first, and a rank that waits there for the others is named by the progress watch
        meet(session.watch, "model_state_dict")
    with collective_call(session.watch, "model_state_dict"):   # a stall here names the call
        return _gathered(session)


def _gathered(session: Any) -> dict[str, torch.Tensor] | None:
    if session.sharding != "fsdp" and session.pipeline is None:   # each rank holds the model whole
        state = session.prepared.state_module.state_dict()
    else:
        state = _torch_gathered(session)
    state = {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    if session.pipeline is None:
        return state if session.rank == 0 else None
    part = state if session.layout.replica == 0 else {}
    parts: list[Any] | None = [None] * dist.get_world_size() if session.rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    if session.rank != 0:
        return None
    whole: dict[str, torch.Tensor] = {}
    for p in parts:
        whole.update(p or {})
    return whole


def _torch_gathered(session: Any) -> dict[str, Any]:
    """A sharded or staged model's state through torch's state-dict helpers (imported here: a DDP job's
    first export does not pay for them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = session.prepared.module
    if not module.state_dict():   # a stage of blocks without parameters or buffers (an activation) holds none
        return {}
    if session.sharding == "fsdp" and session.pipeline is not None:
        # a stage sharded over its replicas: every rank of the stage gets the stage whole (cpu_offload would
        # hand it to global rank 0 only), and the first replica's send it on below
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    if session.sharding == "fsdp":   # every rank of the shards' group gathers; rank 0 receives
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return get_model_state_dict(module)

