"""The planner: for a cluster, a workload and a global batch, choose per device the precision,
share, micro-batch, accumulation, activation checkpointing, sharding or pipeline stage, and
gradient compression, by comparing candidate strategies on the cost model's predicted speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetrain.errors import HetrainError, NoPlanFits
from hetrain.hardware.cluster import HOST_STAGED_SHARE
from hetrain.planning import cost_model as cm
from hetrain.planning.compression import compression_ratio, lossless_for
from hetrain.planning.compression_choice import COMPRESSION_CHOICES, choose_compression
from hetrain.planning.batch_split import FunctionCost, split_even, split_min_max
from hetrain.planning.pieces import fsdp_pieces
from hetrain.planning.plan import STRATEGY_SHARDINGS, BalancePlan, CommPlan, Plan, RankPlan, plan_digest
from hetrain.planning.precision_policy import needs_loss_scaling
from hetrain.planning.explain import PIPELINES_WEIGHED, idle_devices_note, why_not
from hetrain.planning.kinds import Kind, cpu_sharing_notes, extrapolation_notes, figures_notes, kinds_of
from hetrain.planning.measured_rates import MeasuredRates
from hetrain.planning.no_fit import no_fit_message
from hetrain.workload.device_profile import DeviceProfile
from hetrain.workload.profile import WorkloadProfile
from hetrain.vocabulary import OPTIMIZERS, PIPELINE_STRATEGIES
from hetrain.vocabulary import STRATEGIES as VOCABULARY_STRATEGIES

STRATEGIES = ("auto", *(s for s in VOCABULARY_STRATEGIES if s != "hybrid"))  # hybrid plans come from "pipeline"
_ZERO = {"ddp": 0, "balanced": 0, "zero1": 1, "zero3": 3}
GB = 1e9


@dataclass
class Candidate:
    """One strategy's best plan and predicted speed, or why it cannot run."""

    strategy: str
    samples_per_s: float = 0.0
    step_seconds: float = float("inf")
    plan: Plan | None = None
    reason: str = ""
    compression: str = "none"
    exposed_comm_seconds: float = 0.0
    inter_node_seconds: float = 0.0
    shortfall_bytes: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    def summary(self) -> dict:
        return {
            "strategy": self.strategy,
            "feasible": self.feasible,
            "predicted_samples_per_s": round(self.samples_per_s, 3),
            "step_seconds": round(self.step_seconds, 6) if self.feasible else None,
            "compression": self.compression,
            "reason": self.reason,
        }


@dataclass
class PlanResult:
    """The chosen plan, the candidates it was compared with, and the reference speeds."""

    plan: Plan
    candidates: list[Candidate]
    ideal_samples_per_s: float
    uniform_ddp_samples_per_s: float
    notes: list[str] = field(default_factory=list)
    figures: dict[str, str] = field(default_factory=dict)
    """device kind -> where its speed figures came from: modelled, measured-profile or measured-run"""

    def to_dict(self) -> dict:
        """The `hetrain plan --json` object."""
        plan = self.plan.model_dump(mode="json")
        return {
            "strategy": self.plan.strategy,
            "predicted_samples_per_s": self.plan.predicted_samples_per_s,
            "uniform_ddp_samples_per_s": self.uniform_ddp_samples_per_s,
            "ideal_samples_per_s": self.ideal_samples_per_s,
            "ranks": [
                {
                    "rank": r.rank,
                    "device": r.device,
                    "precision": r.precision,
                    "share": r.share,
                    "micro_batch": r.micro_batch,
                    "grad_accum": r.grad_accum,
                    "activation_checkpointing": r.activation_checkpointing,
                    "stage": r.stage,
                    "memory_bytes": r.memory_bytes,
                    "memory_capacity_bytes": r.memory_capacity_bytes,
                    "predicted_step_seconds": r.predicted_step_seconds,
                    "figures": self.figures.get(r.device, "modelled"),
                }
                for r in self.plan.ranks
            ],
            "candidates": [c.summary() for c in self.candidates],
            "notes": self.notes,
            "plan": plan,
            "plan_sha256": plan_digest(plan),
        }


# ---------------------------------------------------------------- helpers


def max_micro_batch(profile: WorkloadProfile, kind: Kind, optimizer: str, zero: int, world: int,
                    ckpt: bool, limit: int) -> int:
    """Largest micro-batch (<= limit) whose predicted memory fits the device; 0 if none does."""
    cap = kind.spec.memory_bytes

    def fits(mb: int) -> bool:
        return kind.memory(profile, mb, optimizer=optimizer, zero=zero, world=world, ckpt=ckpt).total <= cap

    if not fits(1):
        return 0
    lo, hi = 1, max(1, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _comm(profile: WorkloadProfile, topo: cm.CommTopology, zero: int, hook: str, accum: int,
          overlap_seconds: float) -> tuple[float, float]:
    """(exposed seconds, exposed network seconds) of one step's gradient and parameter traffic.

    DDP hides all but the last bucket of its all-reduce under backward; ZeRO-1's parameter
    broadcast after the optimizer step hides under nothing; FSDP's gathers and reduce-scatters
    (per micro-batch) hide under forward and backward except the first block's gather. Over devices
    that exchange data through host memory nothing hides (`cost_model.hidden_seconds`).
    """
    grad = 4.0 * profile.trained_params   # a frozen parameter has no gradient to send
    overlap_seconds = cm.hidden_seconds(topo, overlap_seconds)
    if zero >= 3:   # every weight gathered in forward and in backward; the trained ones' gradients reduce-scattered
        gather = cm.allreduce_cost(4.0 * profile.params, topo, factor=1.0)
        scatter = cm.allreduce_cost(grad, topo, factor=1.0)
        total = accum * (2 * gather.seconds + scatter.seconds)
        first = gather.seconds / max(1, len(profile.blocks))
        exposed = max(total - overlap_seconds, first)
        inter = accum * (2 * gather.inter_node_seconds + scatter.inter_node_seconds)
        return exposed, exposed * (inter / total if total else 0.0)
    ratio = compression_ratio(hook, profile)
    c = cm.allreduce_cost(grad * ratio, topo)
    exposed = cm.exposed_seconds(c.seconds, overlap_seconds, grad * ratio)
    net = exposed * (c.inter_node_seconds / c.seconds if c.seconds else 0.0)
    if zero == 1:   # torch's ZeroRedundancyOptimizer broadcasts every parameter it holds, frozen ones included
        g = cm.allreduce_cost(4.0 * profile.params, topo, factor=1.0)
        exposed, net = exposed + g.seconds, net + g.inter_node_seconds
    return exposed, net


def _memory_note(profile, kind, optimizer, zero, world, micro_batch: int = 1) -> tuple[float, str]:
    """(bytes short, why) of a kind that cannot hold `micro_batch` even with activation checkpointing."""
    need = kind.memory(profile, micro_batch, optimizer=optimizer, zero=zero, world=world, ckpt=True).total
    short = need - kind.spec.memory_bytes
    fits = max_micro_batch(profile, kind, optimizer, zero, world, True, micro_batch) if micro_batch > 1 else 0
    return short, (f"{kind.spec.name} needs {need / GB:.1f} GB at micro-batch {micro_batch} with activation "
                   f"checkpointing, has {kind.spec.memory_bytes / GB:.1f} GB ({short / GB:.1f} GB missing)"
                   + (f"; it holds micro-batch {fits}" if fits else ""))


# ---------------------------------------------------------------- data-parallel strategies


def _per_rank(strategy: str, kinds: list[Kind], global_batch: int, world: int,
              choices: list[tuple[int, bool]]) -> dict[int, tuple[int, int, bool]]:
    """Each rank's (share, micro-batch limit, checkpointing) for each kind's (limit, checkpointing)."""
    if strategy == "ddp":  # as frameworks do: even shares, one micro-batch size everywhere
        even = split_even(global_batch, world)
        mb_all = min(min(mb for mb, _ in choices), even[0])
        shares = dict(zip(sorted(r for k in kinds for r in k.ranks), even))
        return {r: (shares[r], mb_all, c) for k, (_, c) in zip(kinds, choices) for r in k.ranks}
    costs = [FunctionCost(lambda n, k=k, mb=mb, c=c: k.time(n, mb, c)) for k, (mb, c) in zip(kinds, choices)]
    shares = iter(split_min_max(global_batch, costs, counts=[k.count for k in kinds]))
    return {r: (next(shares), mb, c) for k, (mb, c) in zip(kinds, choices) for r in k.ranks}


def _needed_choice(share: int, plain_limit: int, current: tuple[int, bool]) -> tuple[int, bool]:
    """A kind that checkpoints to fit the micro-batch asked for, at its largest share: the share's
    micro-batch, when that fits without checkpointing, runs without it (micro-batches up to
    `plain_limit`, the largest that fits so)."""
    limit, ckpt = current
    mb = even_micro_batch(share, limit)
    if ckpt and share > 0 and mb <= plain_limit:
        return plain_limit, False
    return current


def even_micro_batch(share: int, limit: int) -> int:
    """The micro-batch a share runs at under a limit: the share in as few, equal micro-batches."""
    if share <= 0:
        return 1
    accum = max(1, math.ceil(share / limit))
    return max(1, math.ceil(share / accum))


def data_parallel(strategy: str, cluster, profile: WorkloadProfile, kinds: list[Kind], global_batch: int,
                  optimizer: str, micro_batch: int | None, hook: str = "none") -> Candidate:
    """Uniform DDP ("ddp"), balanced DDP, ZeRO-1 or ZeRO-3 (FSDP) over every device.

    Under ZeRO-3 a kind that holds only small micro-batches without activation checkpointing is also
    priced with it (larger micro-batches, recomputed activations), one kind at a time while that is faster:
    every rank runs the count of micro-batches the job needs, each gathering the model, so a fast card
    held to 2 samples a piece left it nearly idle."""
    zero = _ZERO[strategy]
    world = sum(k.count for k in kinds)
    cand = Candidate(strategy, compression=hook)
    micro_batch = min(micro_batch, global_batch) if micro_batch is not None else None   # no share is larger
    limit = global_batch if micro_batch is None else micro_batch
    plain_limits, choices, others = [], [], []
    for k in kinds:
        plain = max_micro_batch(profile, k, optimizer, zero, world, False, limit)
        with_ckpt = max_micro_batch(profile, k, optimizer, zero, world, True, limit)
        # checkpointing only where the micro-batch asked for (or else 1) does not fit without it
        ckpt = with_ckpt if plain < (micro_batch or 1) else 0
        most = max(plain, ckpt)
        if most < 1:
            short, text = _memory_note(profile, k, optimizer, zero, world, 1)
            cand.reason, cand.shortfall_bytes = f"does not fit: {text}", short
            return cand
        if micro_batch is not None and most < micro_batch:
            # a cap this device cannot reach: it runs as without one, checkpointing only where 1 needs it
            ckpt = ckpt if plain < 1 else 0
            cand.notes.append(f"{strategy}: {k.spec.name} cannot hold the {micro_batch} of --micro-batch (at most "
                              f"{most}, with activation checkpointing): its pieces stay at or below "
                              + (f"{plain}, the largest without checkpointing" if plain else f"{ckpt}"))
        plain_limits.append(plain)
        choices.append((ckpt, True) if ckpt > plain else (plain, False))
        # under ZeRO-3 only: data parallelism without it runs any count of micro-batches a rank needs
        others.append((with_ckpt, True) if zero >= 3 and micro_batch is None and with_ckpt > plain
                      and not choices[-1][1] else None)
    def priced(choice: list[tuple[int, bool]]) -> Candidate:
        return _priced(strategy, cand, cluster, profile, kinds, global_batch, optimizer, hook, plain_limits, choice)

    best = priced(choices)
    improved = True
    while improved:   # one kind at a time to its other choice, while that is faster (a few pricings a kind)
        improved = False
        for i, other in enumerate(others):
            if other is not None and choices[i] != other:
                trial = [other if j == i else c for j, c in enumerate(choices)]
                candidate = priced(trial)
                if candidate.samples_per_s > best.samples_per_s:
                    best, choices, improved = candidate, trial, True
    return best


def _priced(strategy: str, asked: Candidate, cluster, profile: WorkloadProfile, kinds: list[Kind], global_batch: int,
            optimizer: str, hook: str, plain_limits: list[int], choices: list[tuple[int, bool]]) -> Candidate:
    """The plan and predicted speed of one (limit, checkpointing) choice per kind."""
    zero = _ZERO[strategy]
    world = sum(k.count for k in kinds)
    cand = Candidate(strategy, compression=hook, notes=list(asked.notes))
    # a fixed --micro-batch larger than a device's share: once the shares are known, a device that
    # needed checkpointing for the micro-batch asked for may hold its own share without it
    per_rank = _per_rank(strategy, kinds, global_batch, world, choices)
    for _ in range(3):
        better = [_needed_choice(max(per_rank[r][0] for r in k.ranks), p, choice)
                  for k, p, choice in zip(kinds, plain_limits, choices)]
        if better == choices:
            break
        choices = better
        per_rank = _per_rank(strategy, kinds, global_batch, world, choices)
    kind_of = {r: k for k in kinds for r in k.ranks}
    topo = cm.topology_of(cluster)
    kept = cm.data_parallel_efficiency(world)

    def fsdp_step(split: dict[int, tuple[int, int, bool]], pieces: int) -> float:
        t = max(kind_of[r].pieces_time(share, pieces, ckpt) for r, (share, _, ckpt) in split.items())
        return (t + _comm(profile, topo, zero, hook, pieces, t)[0]) / kept

    pieces = fsdp_pieces(kinds, global_batch, choices, per_rank, fsdp_step) if zero >= 3 else None
    ranks, compute, slow_rank = [], {}, None
    for r in range(world):
        share, mb, ckpt = per_rank[r]
        # an idle rank recomputes nothing (nor hides more communication); under ZeRO-3 it runs the job's pieces
        # empty, and checkpoints them where their 16-bit weight casts would not fit beside its state
        ckpt = ckpt and (share > 0 or (pieces is not None and kind_of[r].memory(
            profile, 0, optimizer=optimizer, zero=zero, world=world, ckpt=False).total > kind_of[r].spec.memory_bytes))
        per_rank[r] = (share, mb, ckpt)
        k = kind_of[r]
        if pieces is not None:   # every rank runs the job's count of micro-batches, priced at their size
            accum, mb_even = pieces, max(1, math.ceil(share / pieces))
            t = k.pieces_time(share, pieces, ckpt)
        else:
            accum = max(1, math.ceil(share / mb)) if share else 1
            mb_even = even_micro_batch(share, mb)
            t = k.time(share, mb_even, ckpt)
        compute[r] = (t, accum)
        mem = k.memory(profile, mb_even if share else 0, optimizer=optimizer, zero=zero, world=world,
                       ckpt=ckpt).total
        # under ZeRO-3 the entry keeps the kind's cap (what a re-split may give a piece), not this split's size
        ranks.append(RankPlan(rank=r, device=k.spec.name, share=share, precision=k.precision,
                              micro_batch=mb if pieces is not None else mb_even, grad_accum=accum,
                              activation_checkpointing=ckpt,
                              memory_bytes=mem, memory_capacity_bytes=k.spec.memory_bytes,
                              predicted_step_seconds=t))
        if slow_rank is None or t > compute[slow_rank][0]:
            slow_rank = r
    t_slow, accum_slow = compute[slow_rank]
    # the all-reduce hides under the last micro-batch's backward, FSDP2's gathers and reduce-scatters under
    # every micro-batch's forward and backward; neither under the optimizer step that follows them
    working = max(0.0, t_slow - kind_of[slow_rank].time(0, 1, False))   # the slowest rank's step less its optimizer
    overlap = working if zero >= 3 else working / accum_slow * cm.backward_fraction(per_rank[slow_rank][2])
    exposed, net_exposed = _comm(profile, topo, zero, hook, accum_slow, overlap)
    step = (t_slow + exposed) / kept
    cand.step_seconds, cand.samples_per_s = step, global_batch / step
    cand.exposed_comm_seconds, cand.inter_node_seconds = exposed, net_exposed
    # the two-level all-reduce is a DDP communication hook: FSDP2 (zero3) has none to run it
    two_level = zero < 3 and cm.allreduce_cost(4.0 * profile.trained_params, topo).algorithm == "two-level"
    cand.plan = Plan(
        global_batch_size=global_batch, strategy=strategy, sharding=STRATEGY_SHARDINGS[strategy][0], ranks=ranks,
        # a device planned idle stays so: its balancer may not hand it the min_share of 1 it has by default
        balance=BalancePlan(enabled=strategy != "ddp", min_share=0 if any(r.share == 0 for r in ranks) else 1),
        comm=CommPlan(compression=hook, hierarchical=two_level, islands=cluster.islands() if two_level else None),
        predicted_samples_per_s=cand.samples_per_s,
    )
    cand.reason = (f"step {step * 1e3:.1f} ms: compute {t_slow * 1e3:.1f} ms on the slowest rank, "
                   f"{exposed * 1e3:.1f} ms communication not hidden under backward"
                   + (f", {1 - kept:.0%} lost to {world}-way synchronisation" if world > 1 else ""))
    return cand


# ---------------------------------------------------------------- planner


def _alone_note(cluster, profile, kinds: list[Kind], global_batch: int, optimizer: str, precision: str, calib,
                profiles, rates, chosen: float) -> str | None:
    """A note when the fastest kind's devices alone are predicted faster than the whole cluster: adding
    devices can slow a job (their share of communication, a slower link between unlike devices, a
    piece count or a pipeline bubble they force)."""
    best = max(kinds, key=lambda k: global_batch / k.time(global_batch, global_batch, False))
    name = best.spec.name
    nodes = [node.model_copy(update={"devices": [g for g in node.devices if g.spec.name == name]})
             for node in cluster.nodes if any(g.spec.name == name for g in node.devices)]
    try:
        alone = plan_job(cluster.model_copy(update={"nodes": nodes}), profile, global_batch, optimizer=optimizer,
                         precision=precision, calib=calib, profiles=profiles, rates=rates)
    except HetrainError:
        return None
    faster = alone.plan.predicted_samples_per_s
    if faster <= chosen * 1.05:
        return None
    how = (f"--devices {name}:{best.count}" if len(nodes) == 1 else
           f"a cluster file of the {len(nodes)} nodes that hold them, with only them")
    return (f"{f'the {best.count} {name} alone are' if best.count > 1 else f'the {name} alone is'} predicted at {faster:.1f} samples/s, faster than the plan "
            f"chosen for every device ({chosen:.1f}): the others cost more in communication, synchronisation "
            f"and the pieces or stages they need than their compute brings; plan them alone ({how})")


def ideal_samples_per_s(profile: WorkloadProfile, kinds: list[Kind], global_batch: int, optimizer: str,
                        world: int, pipelines: bool = False) -> float:
    """Sum of each device's own best rate: the whole global batch alone, in micro-batches of its
    largest that fits with the least sharding that lets one fit (plain, ZeRO-1, ZeRO-3), one optimizer
    step, no communication and no recomputation. With `pipelines` among the candidates, or for a
    device that fits none, memory aside (the whole batch as one micro-batch): a stage holding part of
    the model may run micro-batches larger than any the whole model fits (counted at those, a
    pipeline beat this bound, 12.0 against 11.6 samples/s). An upper bound for every candidate: a
    device that takes a fraction of the samples or of the model in a step takes at least that
    fraction of this time."""
    total = 0.0
    for k in kinds:
        fits = (max_micro_batch(profile, k, optimizer, zero, world, False, global_batch) for zero in (0, 1, 3))
        mb = global_batch if pipelines else next((m for m in fits if m), global_batch)
        total += k.count * global_batch / k.time(global_batch, mb, False)
    return total


def plan_job(cluster, profile: WorkloadProfile, global_batch: int, *, optimizer: str = "adamw",
             strategy: str = "auto", precision: str = "auto", micro_batch: int | None = None,
             calib: cm.Calibration | None = None, profiles: dict[str, DeviceProfile] | None = None,
             rates: MeasuredRates | None = None, compression: str = "auto") -> PlanResult:
    """Choose the plan for `profile` on `cluster` at `global_batch` samples per step.

    `profiles` (device kind -> measured DeviceProfile) and `rates` (a run's MeasuredRates) replace
    the cost model's speed figures for the kinds they cover; the notes say which figures are which.
    `compression`: "auto" (none, or a 16-bit all-reduce where the network is the bottleneck) or one by name.
    """
    if global_batch is None or global_batch < 1:
        raise HetrainError(f"global batch must be a positive integer, got {global_batch}; use e.g. --global-batch-size 256")
    if micro_batch is not None and micro_batch < 1:
        raise HetrainError(f"micro-batch must be a positive integer, got {micro_batch}")
    if strategy not in STRATEGIES:
        raise HetrainError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZERS:
        raise HetrainError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
    if compression not in COMPRESSION_CHOICES:
        raise HetrainError(f"unknown compression {compression!r}; choose one of: {', '.join(COMPRESSION_CHOICES)}")
    if compression not in ("auto", "none") and strategy in ("zero3", "pipeline"):
        raise HetrainError(f"--compression {compression} runs as a DDP communication hook, which --strategy {strategy} "
                           "has none of (FSDP2 and pipeline stages reduce their own way); use --strategy balanced, "
                           "ddp or zero1, or leave out --compression")
    if profile.trained_params == 0:   # the runtime refuses a model with nothing to train: so does the plan
        raise HetrainError(f"model {profile.name!r} has no parameter that takes a gradient (its profile's "
                           "trainable_params is 0), so there is no training step to plan; profile the model you "
                           "train, with the parameters it trains requiring a gradient")
    calib = calib or cm.default_calibration()
    kinds = kinds_of(cluster, profile, precision, calib, profiles, rates, optimizer)
    world = sum(k.count for k in kinds)
    if global_batch < world:   # every rank reads part of each global batch, pipeline stages too
        raise HetrainError(f"global batch {global_batch} is smaller than the {world} devices; "
                           f"use a global batch of at least {world}")
    notes = figures_notes(kinds, profile, profiles, rates) + cpu_sharing_notes(kinds, cluster)
    notes += [k.note for k in kinds if k.note]
    notes += [f"node {n.name}: no peer-to-peer access over PCIe between its devices, so collectives go "
              f"through host memory, at {HOST_STAGED_SHARE:.0%} of PCIe and not hidden under compute; "
              "if its driver gives peer access (nvidia-smi topo -p2p r shows OK), write intra_link: pcie in the cluster file"
              for n in cluster.nodes if n.link == "host" and n.size > 1]
    notes += [f"{k.spec.name}: fp16 with dynamic loss scaling" + (" (no bf16 on this chip)" if precision == "auto" else "")
              for k in kinds if needs_loss_scaling(k.precision)]
    args = (cluster, profile, kinds, global_batch, optimizer, micro_batch)
    uniform = data_parallel("ddp", *args, compression if strategy == "ddp" and compression != "auto" else "none")
    cands: dict[str, Candidate] = {"ddp": uniform}
    half = lossless_for(k.spec for k in kinds)
    for s in ("balanced", "zero1"):
        cands[s] = choose_compression(lambda hook, s=s: data_parallel(s, *args, hook), s, len(cluster.nodes), half,
                                      compression if strategy in ("auto", s) else "none")
    cands["zero3"] = data_parallel("zero3", *args) if compression in ("auto", "none") else Candidate(
        "zero3", reason=f"not evaluated: --compression {compression} runs as a DDP communication hook, which "
                        "FSDP2 (zero3) has none of")
    fits_one = any(max_micro_batch(profile, k, optimizer, 0, 1, True, 1) >= 1 for k in kinds)
    # auto weighs pipelines wherever plain data parallelism does not fit every device, and chooses
    # one only where no single device holds the model (a pipeline plan asks more of the script)
    if strategy == "pipeline" or (strategy == "auto" and not (fits_one and cands["balanced"].feasible)):
        from hetrain.planning.pipeline_planner import pipeline_candidates   # it builds this module's Candidates

        for c in pipeline_candidates(cluster, profile, kinds, global_batch, optimizer, micro_batch):
            cands[c.strategy] = c
    else:
        reason = ("not evaluated: plain data parallelism fits every device (--strategy pipeline weighs it)"
                  if strategy == "auto" else f"not evaluated: --strategy {strategy} was asked for")
        for s in PIPELINE_STRATEGIES:
            cands[s] = Candidate(s, reason=reason)
    if strategy == "auto":
        order = ["balanced"]
        if not cands["balanced"].feasible:
            order += ["zero1", "zero3"]
            notes.append(PIPELINES_WEIGHED if fits_one else
                         "model state does not fit every device with plain data parallelism; ZeRO considered")
        if not fits_one:
            order += ["pipeline", "hybrid"]
            notes.append("the model fits on no single device; pipelines considered")
        elif not any(cands[s].feasible for s in order):
            order += ["pipeline", "hybrid"]
            notes.append("no data-parallel plan fits every device; pipelines considered")
        feasible = [cands[s] for s in order if cands[s].feasible]
        chosen = max(feasible, key=lambda c: c.samples_per_s) if feasible else None
        if chosen is not None:
            # faster by a gain that shows at a tenth of a percent: a tie is no reason to explain
            faster = [c for c in cands.values()
                      if c.feasible and c is not chosen and c.samples_per_s > chosen.samples_per_s * 1.0005]
            # one --strategy pipeline weighs both pipeline shapes: the faster of them is the one to name
            best_pipeline = max((c for c in faster if c.strategy in PIPELINE_STRATEGIES),
                                key=lambda c: c.samples_per_s, default=None)
            notes += [why_not(chosen, c) for c in faster
                      if c.strategy not in PIPELINE_STRATEGIES or c is best_pipeline]
    else:
        pick = cands.get(strategy)
        if strategy == "pipeline":
            options = [cands[s] for s in PIPELINE_STRATEGIES if cands[s].feasible]
            pick = max(options, key=lambda c: c.samples_per_s) if options else cands["pipeline"]
        chosen = pick if pick is not None and pick.feasible else None
    if chosen is None:
        raise NoPlanFits(*no_fit_message(profile, kinds, cands, strategy, optimizer, world, micro_batch, global_batch))
    notes += chosen.notes
    if compression not in ("auto", "none") and chosen.compression != compression:
        notes.append(f"{chosen.strategy} runs no DDP communication hook: --compression {compression} does not apply")
    if chosen.strategy not in PIPELINE_STRATEGIES:   # a stage's time comes from the per-block timings
        notes += extrapolation_notes(kinds, chosen.plan.ranks)
        notes += [n for n in [idle_devices_note(chosen.plan.ranks)] if n]
    if uniform.feasible and chosen is not uniform:
        notes.append(f"chose {chosen.strategy}: predicted {chosen.samples_per_s:.1f} samples/s against "
                     f"{uniform.samples_per_s:.1f} for uniform DDP ({chosen.samples_per_s / uniform.samples_per_s:.2f}x)")
    else:
        notes.append(f"chose {chosen.strategy}: predicted {chosen.samples_per_s:.1f} samples/s")
    if strategy == "auto" and len(kinds) > 1:
        notes += [n for n in [_alone_note(cluster, profile, kinds, global_batch, optimizer, precision, calib,
                                          profiles, rates, chosen.samples_per_s)] if n]
    plan = chosen.plan.model_copy(update={"notes": chosen.plan.notes + notes})
    ideal = ideal_samples_per_s(profile, kinds, global_batch, optimizer, world,
                                pipelines=any(c.feasible and c.strategy in PIPELINE_STRATEGIES for c in cands.values()))
    return PlanResult(plan=plan, candidates=list(cands.values()), ideal_samples_per_s=ideal,
                      uniform_ddp_samples_per_s=uniform.samples_per_s if uniform.feasible else 0.0, notes=notes,
                      figures={k.spec.name: k.source for k in kinds})
