"""Which entry of a plan each rank runs: found by the device it has, never by its rank number.

torchrun's rendezvous numbers nodes by node rank or by address, and an elastic restart may bring more or
fewer devices, so a rank looks up its device kind (a catalog name) among the plan's entries:
the first unused entry of that kind is its own. A device of a kind the plan has more of than
entries takes a copy of that kind's first entry; a kind the plan does not have is an error that
says how to re-plan. When the job's devices are not exactly the plan's, the shares are re-split
in proportion to the matched entries' planned shares.

On a machine without GPUs, CPU ranks stand in for the plan's devices: either named per local
rank (`HETRAIN_EMULATE_DEVICES`, as a test or a rehearsal of the real cluster would), or, when
every rank is a plain CPU and the plan has no CPU entries, in the plan's order.
"""

from __future__ import annotations

import os
import socket
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError, ranks_by_value, ranks_text
from hetrain.planning.batch_split import split_proportional
from hetrain.planning.plan import Plan, RankPlan
from hetrain.vocabulary import CPU_DEVICE, Env

if TYPE_CHECKING:
    from hetrain.runtime.pipeline_stages import PipelineLayout


@dataclass(frozen=True)
class Assignment:
    """Each rank's plan entry (its `rank` field is the actual rank) and how they were found."""

    entries: list[RankPlan]
    stand_in: bool = False          # CPU ranks stand in for the plan's devices
    resplit: bool = False           # the shares were re-split for the devices present
    notes: list[str] = field(default_factory=list)
    plan_ranks: list[int] | None = None   # by rank, the plan rank whose entry it took
    nodes: list[str] | None = None        # by rank, the node it runs on

    @property
    def shares(self) -> list[int]:
        return [e.share for e in self.entries]

    @property
    def pieces(self) -> list[tuple[int | None, int]]:
        """Each rank's (micro_batch, grad_accum): how it splits its share into a step's pieces, by rank."""
        return [(e.micro_batch, e.grad_accum) for e in self.entries]

    @property
    def devices(self) -> list[str]:
        """Each rank's device kind, by rank."""
        return [e.device for e in self.entries]


def emulated_kinds() -> list[str] | None:
    """The devices named in HETRAIN_EMULATE_DEVICES (one per local rank), checked against the catalog."""
    text = os.environ.get(Env.EMULATE_DEVICES)
    if not text:
        return None
    from hetrain.hardware.catalog import get_gpu

    kinds = []
    for name in text.split(","):
        name = name.strip()
        kinds.append(CPU_DEVICE if name.lower() == CPU_DEVICE else get_gpu(name).name)
    return kinds


def local_device_kind(device: torch.device, local_rank: int) -> tuple[str, bool]:
    """(the device kind this rank runs as, whether a CPU rank stands in for it)."""
    emulated = emulated_kinds()
    if emulated is not None:
        if local_rank >= len(emulated):
            raise HetrainError(
                f"{Env.EMULATE_DEVICES} names {len(emulated)} devices but this is local rank {local_rank}; "
                "name one device per process on the node"
            )
        return emulated[local_rank], device.type == "cpu" and emulated[local_rank] != CPU_DEVICE
    if device.type != "cuda":
        return CPU_DEVICE, False
    from hetrain.hardware.catalog import match_device_name

    props = torch.cuda.get_device_properties(device)
    spec = match_device_name(props.name, int(props.total_memory))
    return (spec.name if spec is not None else props.name), False


def plan_digest(plan: Plan | None) -> str:
    """A short fingerprint of the plan a rank was given ("none" without one)."""
    import hashlib

    return "none" if plan is None else hashlib.sha256(plan.to_json().encode()).hexdigest()[:12]


def check_same(values: Sequence[str | None], what: str, fix: str) -> None:
    """One setting every node must share, gathered by rank: one line naming which ranks had which."""
    if len(set(values)) > 1:
        seen = "; ".join(f"{ranks_text(ranks)}: {value or 'none'}" for value, ranks in ranks_by_value(values).items())
        raise HetrainError(f"the ranks were given different {what} ({seen}); {fix}")


def find_entries(plan: Plan | None, device: torch.device, local_rank: int, world_size: int) -> Assignment:
    """Every rank's plan entry, looked up by the device kind each rank has (collective: all-gathered)."""
    kind, stand_in = local_device_kind(device, local_rank)
    gathered: list[Any] = [None] * world_size
    node = os.environ.get("GROUP_RANK") or socket.gethostname()   # the elastic agent numbers the nodes
    dist.all_gather_object(gathered, (kind, stand_in, plan_digest(plan), os.environ.get(Env.EMULATE_SPEEDS), node,
                                      os.environ.get(Env.NNODES)))
    kinds, emulated = [g[0] for g in gathered], [g[1] for g in gathered]
    # nodes given different plan files would each split the global batch their own way (samples taken twice
    # or never); speeds go by the job's rank, and a node given its own part would read others' speeds
    check_same([None if g[2] == "none" else f"plan {g[2]}" for g in gathered], "plans",
               "pass the same --plan file to hetrain launch on every node (or none on all)")
    check_same([g[3] for g in gathered], "--emulate-speeds", "give every node the same list, one speed per rank of "
               "the whole job, in the order the ranks are numbered")
    check_same([g[5] for g in gathered], "--nnodes (the rendezvous took the first node's)",
               "start every node with the same --nnodes")
    if plan is None:
        note = (f"no plan (hetrain launch --plan, or {Env.PLAN}): {world_size} rank(s) start from an even "
                "split in fp32, without micro-batches")
        return Assignment([RankPlan(rank=r, device=k, share=0) for r, k in enumerate(kinds)],
                          stand_in=any(emulated), notes=[note])
    return assign_entries(plan, kinds, emulated, nodes=[g[4] for g in gathered])


def _counts(kinds: Iterable[str]) -> str:
    """'a100: 1, v100: 2'."""
    return ", ".join(f"{kind}: {n}" for kind, n in sorted(Counter(kinds).items()))


def assign_entries(plan: Plan, kinds: Sequence[str], emulated: Sequence[bool] | None = None,
                   nodes: Sequence[str] | None = None) -> Assignment:
    """Each rank's entry of `plan`, given the device kind (and node) of every rank (by rank)."""
    world = len(kinds)
    if world < 1:
        raise HetrainError("a job needs at least one rank")
    plan_kinds = [e.device for e in plan.ranks]
    kinds = list(kinds)
    notes: list[str] = []
    stand_in = bool(emulated) and any(emulated)
    if all(k == CPU_DEVICE for k in kinds) and CPU_DEVICE not in plan_kinds:
        kinds = [plan_kinds[r % len(plan_kinds)] for r in range(world)]
        stand_in = True
        notes.append("CPU ranks stand in for the plan's devices in its order: "
                     + ", ".join(f"rank {r} as {k}" for r, k in enumerate(kinds)))
    elif all(k == CPU_DEVICE for k in plan_kinds) and any(k != CPU_DEVICE for k in kinds):
        # a plan written by hand without devices (RankPlan's default is cpu): its entries go by rank
        plan = plan.model_copy(update={"ranks": [e.model_copy(update={"device": kinds[r]}) if r < world else e
                                                 for r, e in enumerate(plan.ranks)]})
        plan_kinds = [e.device for e in plan.ranks]
        notes.append("the plan names no device (cpu, RankPlan's default): its entries go to the ranks in order, on "
                     "the devices they have")
    unknown = sorted({k for k in kinds if k not in plan_kinds})
    if unknown:
        have = ", ".join(sorted(set(plan_kinds)))
        where = ", ".join(f"{u} on {ranks_text([r for r, k in enumerate(kinds) if k == u])}" for u in unknown)
        raise HetrainError(
            f"this job runs {where}, which the plan has no entry for (its devices: {have}); "
            "re-plan for the devices you have: `hetrain plan --devices KIND:COUNT,... --out plan.json`"
        )
    free: dict[str, list[RankPlan]] = defaultdict(list)
    for entry in plan.ranks:
        free[entry.device].append(entry)
    used_each_once = world == plan.world_size
    picked: list[RankPlan] = []
    taken: list[int] = []   # by rank, the plan rank of its entry
    for r, kind in enumerate(kinds):
        if free[kind]:
            entry = free[kind].pop(0)
        else:
            entry = next(e for e in plan.ranks if e.device == kind)
            used_each_once = False
        taken.append(entry.rank)
        picked.append(entry.model_copy(update={"rank": r}))
    shares = [e.share for e in picked]
    resplit = not used_each_once or sum(shares) != plan.global_batch_size
    if resplit and plan.pipeline is None:
        floor = max(plan.global_batch_size * 1e-3, 1e-6)
        shares = split_proportional(plan.global_batch_size, [max(float(s), floor) for s in shares])
        if world != plan.world_size:
            why = f"the plan has {plan.world_size} entries for {world} ranks"
        elif not used_each_once:
            why = f"the job's devices ({_counts(kinds)}) are not the plan's ({_counts(e.device for e in plan.ranks)})"
        else:
            why = f"the plan's shares sum to {sum(e.share for e in plan.ranks)}, not {plan.global_batch_size}"
        notes.append(f"{why}: shares re-split to {shares}")
    entries = [e.model_copy(update={"share": s}) for e, s in zip(picked, shares)]
    if emulated and any(emulated):
        notes.append(f"CPU ranks stand in for the devices {Env.EMULATE_DEVICES} names: " + ", ".join(
            f"rank {e.rank} as {e.device}" for e, stands in zip(entries, emulated) if stands))
    if [e.device for e in entries] != [e.device for e in sorted(plan.ranks, key=lambda e: e.rank)][:world] \
            and not resplit:
        notes.append("ranks found their entries by device: " + ", ".join(
            f"rank {e.rank} runs {e.device} ({e.precision})" for e in entries))
    return Assignment(entries=entries, stand_in=stand_in, resplit=resplit, notes=notes,
                      plan_ranks=taken, nodes=list(nodes) if nodes is not None else None)


def comm_for_world(plan: Plan, assignment: Assignment) -> tuple[Any, str | None]:
    """The plan's comm section for the ranks of `assignment`, and a note when it had to change. The islands
    of a two-level all-reduce name the plan's ranks: where the ranks arrived in another order (torchrun
    numbers nodes as they join) they follow the ranks that took those entries, or, where that would put
    one island on two nodes, become this job's nodes; a job on another number of ranks (an elastic restart
    on fewer or more devices) all-reduces flat."""
    comm, world = plan.comm, len(assignment.entries)
    if comm.islands is None or not comm.hierarchical:   # only a two-level all-reduce reads the islands
        return comm, None
    from hetrain.runtime.hierarchical import validate_islands

    validate_islands(comm.islands, plan.world_size)   # they name the plan's ranks, each once: else one line
    if world != plan.world_size:
        note = (f"the plan's islands {comm.islands} name its {plan.world_size} ranks and this job has {world}: "
                "gradients all-reduce flat, not in two levels (re-plan for these devices to get them back)")
        return comm.model_copy(update={"hierarchical": False, "islands": None}), note
    taken, nodes = assignment.plan_ranks, assignment.nodes
    if taken is None:
        return comm, None
    if sorted(taken) == list(range(world)):
        where = {p: r for r, p in enumerate(taken)}
        islands = [sorted(where[p] for p in island) for island in comm.islands]
        if nodes is None or all(len({nodes[r] for r in island}) == 1 for island in islands):
            if islands == comm.islands:
                return comm, None
            return comm.model_copy(update={"islands": islands}), (
                f"the ranks took the plan's entries in another order: its islands {comm.islands} are ranks "
                f"{islands} of this job")
    if nodes is None:
        return comm.model_copy(update={"hierarchical": False, "islands": None}), (
            f"the ranks took the plan's entries in another order and their nodes are unknown: the plan's islands "
            f"{comm.islands} give way to a flat all-reduce")
    islands = list(ranks_by_value(nodes).values())
    return comm.model_copy(update={"islands": islands}), (
        f"the plan's islands {comm.islands}, followed to the ranks that took their entries, would join ranks of "
        f"different nodes (nodes of different sizes, numbered by the rendezvous): the islands are this job's nodes, "
        f"ranks {islands}")


def pipeline_assignment(assignment: Assignment, plan: Plan, rank: int) -> tuple[Assignment, "PipelineLayout"]:
    """A pipeline plan's entries for the loader, and this rank's place in the pipeline grid.

    Each replica's share of the global batch is read spread over its ranks (they gather it), and
    the pipeline, not the loader, cuts it into the plan's micro-batches: so each entry's `share`
    becomes the samples its loader reads, with no micro-batching of its own.
    """
    from hetrain.runtime.pipeline_stages import loader_shares, pipeline_layout, replica_shares

    layout = pipeline_layout(assignment.entries, plan.pipeline, rank)
    shares = replica_shares(assignment.entries, layout, plan.global_batch_size)
    reads = loader_shares(layout, shares, len(assignment.entries))
    entries = [e.model_copy(update={"share": reads[e.rank], "micro_batch": None, "grad_accum": 1})
               for e in assignment.entries]
    notes = assignment.notes + [
        f"pipeline over {layout.stages} ranks, {len(plan.pipeline.stages)} stages {plan.pipeline.stages}"
        + (f" in {plan.pipeline.chunks} chunks per rank" if plan.pipeline.chunks > 1 else "")
        + f" ({plan.pipeline.schedule}, {plan.pipeline.microbatches} micro-batches) x {layout.replicas} replica(s) "
        f"with shares {shares}"]
    return Assignment(entries=entries, stand_in=assignment.stand_in, resplit=assignment.resplit,
                      notes=notes), layout
