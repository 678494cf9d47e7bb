"""FSDP2 inside pipeline stages: each stage's parameters sharded over the ranks that hold that
stage (one per replica), as torchtitan composes pipeline and data parallelism.

The ranks form a (stage, replica) device mesh; a stage's blocks, then the stage itself, are
`fully_shard`-ed over its replica dimension. FSDP2's reduce-scatter averages over the replicas,
so each micro-batch loss's item weight is multiplied by their number
(`hetrain.runtime.pipeline_schedule`): the result is the item-weighted sum, and unequal replica
shares stay exact.
"""

from __future__ import annotations

import torch
from collections import OrderedDict

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hetrain.runtime.pipeline_stages import PipelineLayout


def stage_mesh(layout: PipelineLayout, device: torch.device) -> DeviceMesh:
    """This stage's 1-D mesh over its replicas (every rank builds the whole (stage, replica) mesh)."""
    ranks = torch.tensor([[row[j] for row in layout.grid] for j in range(layout.stages)])
    mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("stage", "replica"))
    return mesh["replica"]


def shard_stage(chunks: list[nn.Module], layout: PipelineLayout, device: torch.device) -> list[nn.Module]:
    """FSDP2 over each block of the rank's stages, then each stage (gradients averaged over replicas)."""
    from torch.distributed.fsdp import fully_shard

    mesh = stage_mesh(layout, device)
    for chunk in chunks:
        for block in list(chunk.children()):
            fully_shard(block, mesh=mesh)
        fully_shard(chunk, mesh=mesh)
    return chunks


class ShardedChunks(nn.Sequential):
    """A rank's FSDP2-sharded chunks (interleaved stages) as one module of their blocks, under their
    own names: FSDP2's per-step settings reach every chunk."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__(OrderedDict(b for chunk in chunks for b in chunk.named_children()))
        self.chunks = list(chunks)   # a plain list: the blocks above are the registered submodules

    def set_requires_gradient_sync(self, sync: bool) -> None:
        for chunk in self.chunks:
            chunk.set_requires_gradient_sync(sync)

    def set_reshard_after_forward(self, reshard: bool) -> None:
        for chunk in self.chunks:
            chunk.set_reshard_after_forward(reshard)

    def set_reshard_after_backward(self, reshard: bool) -> None:
        for chunk in self.chunks:
            chunk.set_reshard_after_backward(reshard)
