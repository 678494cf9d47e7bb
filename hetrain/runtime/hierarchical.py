"""Two-level all-reduce: reduce inside each island, all-reduce across island leaders, broadcast back.

An island is a set of ranks joined by a fast link (NVLink inside a node); between islands the
link is slow (PCIe across sockets, the network between nodes). Each bucket is summed onto the
island's leader (its first rank) over the fast link, the leaders average the island sums over
the slow link (with the plan's compression, if any), and each leader broadcasts the result in
its island. Only one rank per island sends over the slow link, so the slow link carries one
bucket per island instead of one per rank.

Islands come from the plan (``comm.islands``), which the planner fills from the cluster's
topology (``hetrain.hardware.topology.islands_from_topo``) or the cluster file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.comm_hooks import FlatHookState, flat_state
from hetrain.runtime.compression import CommStats, SerialRunner, allgather_bytes
from hetrain.runtime.environment import collective_timeout

if TYPE_CHECKING:
    from hetrain.planning.plan import CommPlan


def validate_islands(islands: list[list[int]] | None, world_size: int) -> list[list[int]]:
    """The islands as sorted lists, after checking that they split ranks 0..world_size-1 exactly once."""
    if not islands:
        raise HetrainError(
            "comm.hierarchical is true but comm.islands is empty; list the groups of ranks that share a fast "
            "link (e.g. [[0,1,2,3],[4,5,6,7]]) or set comm.hierarchical to false"
        )
    seen = sorted(r for island in islands for r in island)
    if seen != list(range(world_size)) or any(not island for island in islands):
        raise HetrainError(
            f"comm.islands={islands} must name every rank 0..{world_size - 1} exactly once, in non-empty "
            "islands; fix the islands to match the world size"
        )
    return [sorted(island) for island in islands]


@dataclass
class IslandGroups:
    """The process groups of a two-level all-reduce, as seen from this rank."""

    islands: list[list[int]]
    island: list[int]
    island_group: dist.ProcessGroup
    leaders: list[int]
    leaders_group: dist.ProcessGroup | None  # None on ranks that do not lead an island

    @property
    def leader(self) -> int:
        return self.island[0]

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader


def island_groups(islands: list[list[int]]) -> IslandGroups:
    """Create one group per island and one of the leaders; every rank must call this, in the same order."""
    world = dist.get_world_size()
    islands = validate_islands(islands, world)
    me = dist.get_rank()
    own_group = None
    for island in islands:  # every rank creates every group, in the same order
        group = dist.new_group(island, timeout=collective_timeout())   # the job's, not gloo's 30 min
        if me in island:
            own_group, own_island = group, island
    leaders = [island[0] for island in islands]
    leaders_group = dist.new_group(leaders, timeout=collective_timeout())
    return IslandGroups(islands, own_island, own_group, leaders, leaders_group if me in leaders else None)


@dataclass
class HierarchicalState:
    """State of the two-level hook: island groups and, on leaders, the hook state used between islands."""

    groups: IslandGroups
    across: FlatHookState | None
    world_size: int
    stats: CommStats = field(default_factory=CommStats)
    runner: SerialRunner = field(default_factory=SerialRunner)

    def reduce(self, bucket: dist.GradBucket) -> torch.Tensor:
        """Average ``bucket`` over all ranks in two levels (blocking); counts bytes per level."""
        buf = bucket.buffer()
        payload = buf.numel() * buf.element_size()
        g = self.groups
        m = len(g.island)
        if m > 1:
            self.stats.add(allgather_bytes(payload, m), "intra_island")
            dist.reduce(buf, dst=g.leader, group=g.island_group)
        if self.across is not None:
            # island sum * L / W, averaged over the L leaders, is the sum over all ranks / W
            buf.mul_(len(g.leaders) / self.world_size)
            before = self.across.stats.bytes_sent
            out = self.across.reduce(bucket)
            if out is not buf:
                buf.copy_(out)
            self.stats.add(self.across.stats.bytes_sent - before, "inter_island")
        if m > 1:
            self.stats.add(allgather_bytes(payload, m), "intra_island")
            dist.broadcast(buf, src=g.leader, group=g.island_group)
        return buf

    def forget_feedback(self) -> None:
        """Drop what the compression between islands carries to the next step (leaders only hold any)."""
        if self.across is not None:
            self.across.forget_feedback()


def hierarchical_state(
    comm: "CommPlan", process_group: dist.ProcessGroup | None = None, powersgd_error_feedback: bool = True
) -> HierarchicalState:
    """The two-level hook state from the plan: islands from ``comm.islands``, ``comm.compression`` between them."""
    if process_group is not None and process_group != dist.group.WORLD:
        raise HetrainError(
            "comm.hierarchical builds its groups over the whole world; pass process_group=None"
        )
    groups = island_groups(comm.islands)
    across = flat_state(comm, groups.leaders_group, powersgd_error_feedback) if groups.is_leader else None
    return HierarchicalState(groups, across, dist.get_world_size())
