"""Pipeline and hybrid candidates: the model's blocks cut into contiguous stages by each device's speed
(the layer partition's dynamic programme), replicated d times for data parallelism, under 1F1B or,
where the cost model predicts it faster, interleaved 1F1B with several chunks per rank.
"""

from __future__ import annotations

import math

from hetrain.planning.batch_split import split_even
from hetrain.planning import cost_model as cm
from hetrain.planning.cost_model import pipeline_bubble
from hetrain.planning.kinds import Kind
from hetrain.planning.no_fit import MORE_STAGES, ONE_BLOCK
from hetrain.planning.partition import interleaved_stages, microbatches_at_most, partition_blocks
from hetrain.planning.plan import BalancePlan, PipelinePlan, Plan, RankPlan
from hetrain.planning.planner import Candidate
from hetrain.workload.profile import WorkloadProfile

CHUNKS = (1, 2, 3, 4)
"""Stages per rank the planner tries: 1 is plain 1F1B, more is interleaved 1F1B."""


def _divisors_desc(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def interleaved_rounds_fit(m: int, p: int) -> bool:
    """torch's interleaved 1F1B runs m micro-batches in rounds of about p: m must be a multiple of m // p."""
    return m % max(1, m // p) == 0


def in_flight(p: int, j: int, m: int, chunks: int) -> int:
    """Micro-batches whose activations the rank at position j holds at once, in whole-stage units:
    p - j under 1F1B; under torch's interleaved 1F1B, its warm-up chunks plus one, over the chunks."""
    if chunks == 1:
        return min(p - j, m)
    per_round = m // max(1, m // p)
    held = min((chunks - 1) * per_round + 2 * (p - 1 - j) + 1, m * chunks)   # chunk forwards awaiting backward
    return max(1, math.ceil(held / chunks))


def pipeline_candidates(cluster, profile: WorkloadProfile, kinds: list[Kind], global_batch: int,
                        optimizer: str, micro_batch: int | None) -> list[Candidate]:
    """Pipelines of contiguous blocks (layer DP) replicated d times for data parallelism.

    Each of the d replicas holds the same mix of device kinds (counts divisible by d), one device
    per stage; stage j of every replica is the same kind, so the partition is shared.
    """
    out = {"pipeline": Candidate("pipeline"), "hybrid": Candidate("hybrid")}
    blocks = profile.blocks
    n_blocks = len(blocks)
    if n_blocks < 2:
        for c in out.values():
            c.reason = ONE_BLOCK
        return list(out.values())
    calib = cm.default_calibration()
    multi_node = len(cluster.nodes) > 1
    devices = cluster.devices()
    link = cluster.inter_node_bytes_per_s if multi_node else min(d.intra_bytes_per_s for d in devices)
    staged = not multi_node and cm.topology_of(cluster).host_staged
    counts = [k.count for k in kinds]
    memo: dict = {}    # (kind, blocks, micro-batch, in flight, sharding) -> stage_cost
    times: dict = {}   # (kind, blocks, micro-batch, checkpointing) -> stage_seconds
    parts: dict = {}   # (a, b) -> the profile of blocks [a, b) alone

    def stage_cost(kind: Kind, a: int, b: int, mb: int, in_flight: int, zero: int = 0
                   ) -> tuple[float, bool, int] | None:
        """(seconds of one micro-batch, activation checkpointing, peak bytes) of a stage holding blocks
        [a, b), or None when it fits in no way; `zero` 3: sharded (FSDP2) over the stage's replicas."""
        key = (kind.spec.name, a, b, mb, in_flight, zero, replicas[0] if zero else 1)
        if key not in memo:
            sub = slice(a, b)
            result = None
            for ckpt in (False, True):
                mem = cm.memory_estimate(profile, kind.precision, mb, optimizer=optimizer, checkpointing=ckpt,
                                         blocks=sub, in_flight=in_flight, zero=zero, world=replicas[0],
                                         pipelined=True).total
                if mem <= kind.spec.memory_bytes:
                    result = (stage_seconds(kind, a, b, mb, ckpt), ckpt, mem)
                    break
            memo[key] = result
        return memo[key]

    def stage_seconds(kind: Kind, a: int, b: int, mb: int, ckpt: bool) -> float:
        """Seconds of one micro-batch through blocks [a, b) on `kind` (measured where its profile has
        the blocks, else modelled); whatever the stage's memory, so kept apart from `stage_cost`'s."""
        key = (kind.spec.name, a, b, mb, ckpt)
        if key not in times:
            t = kind.stage_seconds(len(blocks), a, b, mb, ckpt)
            if t is None:
                if (a, b) not in parts:
                    parts[(a, b)] = stage_profile(profile, a, b)
                t = cm.compute_seconds(parts[(a, b)], kind.spec, kind.precision, mb, mb, ckpt, calib)
            times[key] = t
        return times[key]

    def stage_optimizer_seconds(kind: Kind, ranges: list[tuple[int, int]], shards: int) -> float:
        """The optimizer step over the parameters of the blocks in `ranges` (a 1/shards slice when
        sharded): it runs once per step after the last backward, on every rank at once, so the slowest
        rank's sets the step's."""
        params = sum(profile.held_trained_params(a, b) for a, b in ranges)
        return kind.optimizer_seconds(params / shards, profile.trained_params)

    speed = sorted(kinds, key=lambda k: k.sample_s)
    replicas = [1]   # the replica count stage_cost shards over (set per search)

    def search(d: int, zero: int) -> None:
        """The best plan of d replicas (stages sharded over them when `zero` is 3) into out[label]."""
        replicas[0] = d
        per = [c // d for c in counts]
        p = sum(per)
        label = "pipeline" if d == 1 else "hybrid"
        if p < 2 or p > n_blocks or out[label].feasible:
            return
        b_max = math.ceil(global_batch / d)
        sizes = [micro_batch] if micro_batch else sorted({min(b_max, 2**i) for i in range(0, 7)})
        for order in (speed, speed[::-1]):
            stage_kinds = [k for k in order for _ in range(per[kinds.index(k)])]
            grid = replica_grid(kinds, stage_kinds, per)
            for asked in sizes:
                for v in CHUNKS:
                    # the count the runtime runs as it is (a divisor of the batch), micro-batches at most `asked`
                    m = microbatches_at_most(b_max, asked, p if v > 1 else None)
                    mb = b_max // m
                    if v > 1 and (any(row != sorted(row) for row in grid) or not interleaved_rounds_fit(m, p)):
                        continue   # torch's interleaved 1F1B needs each replica's stages on increasing ranks

                    def fits(j, a, b, mb=mb, m=m, v=v, sk=stage_kinds):
                        return stage_cost(sk[j], a, b, mb, in_flight(p, j, m, v), zero) is not None

                    def time(j, a, b, mb=mb, m=m, v=v, sk=stage_kinds):
                        return stage_cost(sk[j], a, b, mb, in_flight(p, j, m, v), zero)[0]

                    # Interleaved, a rank's chunks are not one range of blocks, but hold as many: the
                    # contiguous partition stands for their count (exact for alike layers).
                    found = partition_blocks(n_blocks, p, time, fits, min_size=v)
                    if found is None:
                        continue
                    bounds, slot = found
                    p2p = transfer_seconds(profile, bounds, mb, link)
                    optimizer_s = [stage_optimizer_seconds(k, ranges, d if zero else 1)
                                   for k, ranges in zip(stage_kinds, held_blocks(bounds, v))]
                    # d replicas in lockstep lose what d-way data parallelism loses (synchronisation,
                    # stragglers); each rank's optimizer step after their gradient sum runs alone
                    step = (cm.pipeline_step_seconds([slot] * p, m, p2p, chunks=v) + replica_sync_seconds(
                        bounds, d, m, zero, slot)) / cm.data_parallel_efficiency(d, calib) + max(optimizer_s)
                    if step < out[label].step_seconds:
                        out[label] = _pipeline_plan(label, profile, kinds, stage_kinds, per, d, bounds, mb, m, v,
                                                    global_batch, step, stage_cost, p, zero, optimizer_s)

    def replica_sync_seconds(bounds: list[tuple[int, int]], d: int, m: int, zero: int, slot: float) -> float:
        """Exposed time of the replicas' gradient sum (all-reduce, partly under the last backward);
        sharded, a reduce-scatter plus the weights' gathers (cm.sharded_stage_gathers)."""
        weights = max(4.0 * profile.held_params(a, b) for a, b in bounds)
        grads = max(4.0 * profile.held_trained_params(a, b) for a, b in bounds)   # a frozen weight sends none
        topo = cm.CommTopology((1,) * d if multi_node else (d,), link, cluster.inter_node_bytes_per_s, staged)
        if zero == 0:
            comm = cm.allreduce_cost(grads, topo).seconds
            return cm.exposed_seconds(comm, cm.hidden_seconds(topo, slot * cm.backward_fraction(False)), grads)
        gathers = cm.sharded_stage_gathers(m) * cm.allreduce_cost(weights, topo, factor=1.0).seconds
        return gathers + cm.allreduce_cost(grads, topo, factor=1.0).seconds

    divisors = _divisors_desc(math.gcd(*counts))
    for d in divisors:
        search(d, 0)
    if not out["hybrid"].feasible:   # shard a stage over its replicas only where unsharded stages fit nowhere
        for d in divisors:
            if d > 1:
                search(d, 3)
    for label, c in out.items():
        if not c.feasible:
            c.reason = c.reason or _no_plan_reason(label, counts, divisors, n_blocks)
    return list(out.values())


def transfer_seconds(profile: WorkloadProfile, bounds: list[tuple[int, int]], micro_batch: int, link: float) -> float:
    """One micro-batch's hand-off between stages over `link` (bytes/s), the largest of the cuts: stage outputs,
    and the gradients sent back of them, travel in fp32 whatever each stage computes in (docs/pipeline.md),
    4 bytes an element of the profile's activations."""
    scale = 4 / profile.activation_dtype_bytes
    largest = max(micro_batch * profile.blocks[b - 1].output_bytes_per_sample * scale for _, b in bounds[:-1])
    return largest / (link * cm.LINK_EFFICIENCY)


def stage_profile(profile: WorkloadProfile, a: int, b: int) -> WorkloadProfile:
    """The profile of blocks [a, b) alone, as a stage holding them runs: their parameters (a tied copy
    included), those of them that train, FLOPs and activations."""
    blocks = profile.blocks[a:b]
    return profile.model_copy(update={
        "params": max(1, profile.held_params(a, b)),
        "trainable_params": profile.held_trained_params(a, b),
        "flops_per_sample": max(1.0, sum(x.flops_per_sample for x in blocks)),
        "activation_bytes_per_sample": sum(x.activation_bytes_per_sample for x in blocks),
        "blocks": [],
    })


def _no_plan_reason(label: str, counts: list[int], divisors: list[int], n_blocks: int) -> str:
    """Why no pipeline (d = 1) or hybrid (d > 1 replicas) plan exists: the grid, else memory."""
    grids = [(d, sum(c // d for c in counts)) for d in divisors if (d == 1) == (label == "pipeline")]
    if not grids:
        return "device counts share no divisor > 1 for replicas"
    if all(stages < 2 for _, stages in grids):
        return ("a pipeline needs 2 or more devices" if label == "pipeline" else
                f"each replica would hold one device: hybrid needs 2 or more replicas of 2 or more devices "
                f"(these {sum(counts)} devices make none)")
    if all(stages > n_blocks for _, stages in grids if stages >= 2):
        return MORE_STAGES.format(blocks=n_blocks)
    return "no partition fits: the stages lack memory"


def held_blocks(bounds: list[tuple[int, int]], chunks: int) -> list[list[tuple[int, int]]]:
    """Per pipeline position j, the block ranges its rank holds: its stage, or under interleaved
    1F1B its chunks (stages j, j + p, ...)."""
    if chunks == 1:
        return [[bound] for bound in bounds]
    stages = interleaved_stages([b - a for a, b in bounds], chunks)
    return [stages[j::len(bounds)] for j in range(len(bounds))]


def rank_places(kinds: list[Kind], stage_kinds: list[Kind], per: list[int]) -> dict[int, tuple[int, int]]:
    """Each rank's (replica, stage): the i-th rank of a kind holding n stages per replica is in replica
    i // n, at that kind's (i % n)-th stage."""
    places: dict[int, tuple[int, int]] = {}
    for k, n in zip(kinds, per):
        stages = [j for j, sk in enumerate(stage_kinds) if sk is k]
        for i, r in enumerate(k.ranks):
            places[r] = (i // n, stages[i % n])
    return places


def replica_grid(kinds: list[Kind], stage_kinds: list[Kind], per: list[int]) -> list[list[int]]:
    """grid[replica][stage] = rank."""
    places = rank_places(kinds, stage_kinds, per)
    grid = [[0] * len(stage_kinds) for _ in range(max(i for i, _ in places.values()) + 1)]
    for r, (i, j) in places.items():
        grid[i][j] = r
    return grid


def _pipeline_plan(label, profile, kinds, stage_kinds, per, d, bounds, mb, m, chunks, global_batch, step,
                   stage_cost, p, zero, optimizer_s) -> Candidate:
    replica_shares = split_even(global_batch, d)
    rank_stage = rank_places(kinds, stage_kinds, per)
    ranks = []
    for r in sorted(rank_stage):
        replica, j = rank_stage[r]
        k = stage_kinds[j]
        a, b = bounds[j]
        t, ckpt, mem = stage_cost(k, a, b, mb, in_flight(p, j, m, chunks), zero)
        ranks.append(RankPlan(rank=r, device=k.spec.name, share=replica_shares[replica],
                              precision=k.precision, micro_batch=mb, grad_accum=m, activation_checkpointing=ckpt,
                              stage=j, memory_bytes=mem, memory_capacity_bytes=k.spec.memory_bytes,
                              predicted_step_seconds=t * m + optimizer_s[j]))
    if chunks == 1:
        stages, schedule, name = bounds, "1f1b", "1F1B"
        formula = "(p-1)/(m+p-1)"
    else:
        stages = interleaved_stages([b - a for a, b in bounds], chunks)
        schedule, name = "interleaved-1f1b", f"interleaved 1F1B ({chunks} chunks per device)"
        formula = "(p-1)/(v*m+p-1)" if m >= p else "1-v*m/(v*p+m-1) (fewer micro-batches than stages)"
    plan = Plan(global_batch_size=global_batch, strategy=label, sharding="fsdp" if zero else "none", ranks=ranks,
                balance=BalancePlan(enabled=False),
                pipeline=PipelinePlan(stages=[[a, b] for a, b in stages], schedule=schedule, microbatches=m,
                                      chunks=chunks),
                predicted_samples_per_s=global_batch / step)
    c = Candidate(label, samples_per_s=global_batch / step, step_seconds=step, plan=plan)
    bubble, kept = pipeline_bubble(p, m, chunks), cm.data_parallel_efficiency(d)
    c.reason = (f"{d} replica(s) of a {p}-rank {name} pipeline, {m} micro-batches of {mb}; "
                f"predicted bubble {bubble:.1%}" + (f", {1 - kept:.0%} lost to {d}-way synchronisation" if d > 1 else "")
                + f"; stages {[list(x) for x in stages]}")
    held = (lambda a, b: f"blocks {a}-{b - 1}") if chunks == 1 else (lambda a, b: f"{b - a} blocks")
    kinds_by_stage = ", ".join(f"{j}: {k.spec.name} {held(a, b)}" for j, (k, (a, b)) in
                               enumerate(zip(stage_kinds, bounds)))
    c.notes.append(f"{label}: the model's {len(profile.blocks)} blocks cut into {p} stages by each stage's speed "
                   f"({kinds_by_stage}), {d} replica(s); {name} with {m} micro-batches of {mb}: predicted bubble "
                   f"{formula} = {bubble:.1%} of the step")
    if zero:
        c.notes.append(f"{label}: unsharded, no stage layout fits the devices' memory; each stage is sharded with "
                       f"FSDP2 (ZeRO-3) over its {d} replicas (sharding fsdp), its weights gathered m + 1 "
                       "times a step")
    return c
