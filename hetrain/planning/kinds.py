"""Device kinds of a cluster and their compute figures for one workload: from a run's measured
rates, a measured device profile, or the cost model, each saying which."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hetrain.errors import HetrainError
from hetrain.hardware.catalog import rank_threads
from hetrain.planning import cost_model as cm
from hetrain.planning.batch_split import split_even
from hetrain.planning.measured_rates import DeviceRate, MeasuredRates
from hetrain.planning.precision_policy import choose_precision
from hetrain.planning.published_check import caveat
from hetrain.workload.device_profile import DeviceProfile, interpolate
from hetrain.workload.profile import WorkloadProfile

__all__ = ["Kind", "extrapolation_notes", "figures_notes", "kinds_of"]


@dataclass
class Kind:
    """Devices of one catalog model in the cluster, and their compute figures for this workload.

    Figures come from a run's measured rates (`rate`), else a measured device profile
    (`measured`), else the cost model (`sample_s`, `fixed_s`); `source` says which.
    """

    spec: object
    ranks: list[int]
    precision: str
    note: str | None
    sample_s: float
    sample_s_ckpt: float
    fixed_s: float
    optimizer_s: float = 0.0   # the optimizer step, once per step: modelled, or a profile's (measured_optimizer_seconds)
    source: str = "modelled"
    measured: DeviceProfile | None = None
    rate: DeviceRate | None = None
    peaks: list[tuple[int, int]] | None = None   # (micro_batch, peak bytes) a device profile measured

    def activations(self, profile: WorkloadProfile, micro_batch: int, ckpt: bool) -> float | None:
        """Bytes one micro-batch holds for backward, from the profile's measured peaks; None: model them.

        A profile's peak is a forward + backward of the whole model without an optimizer: fp32
        weights, their 16-bit copies under autocast, fp32 gradients and the activations. The
        activations are the peak less the first three, linear in the micro-batch through the
        measured sizes; under activation checkpointing they shrink by the model's own ratio."""
        if not self.peaks:
            return None
        weights, grads, _ = cm.state_bytes(profile.params, self.precision, "sgd-nomomentum",
                                           trained=profile.trained_params)
        points = [(mb, max(0.0, peak - weights - grads)) for mb, peak in self.peaks]
        act = interpolate(points, micro_batch)
        if ckpt:
            full = cm.activation_bytes_per_sample(profile, self.precision, False)
            act *= cm.activation_bytes_per_sample(profile, self.precision, True) / full if full > 0 else 1.0
        return act

    def memory(self, profile: WorkloadProfile, micro_batch: int, *, optimizer: str, zero: int, world: int,
               ckpt: bool) -> cm.MemoryEstimate:
        """Predicted peak memory of one device of this kind: measured activations where a profile has them."""
        return cm.memory_estimate(profile, self.precision, micro_batch, optimizer=optimizer, zero=zero, world=world,
                                  checkpointing=ckpt, activations=self.activations(profile, micro_batch, ckpt))

    @property
    def count(self) -> int:
        return len(self.ranks)

    def stage_seconds(self, n_blocks: int, a: int, b: int, micro_batch: int, ckpt: bool) -> float | None:
        """Measured seconds of a pipeline stage holding blocks [a, b), or None (model it)."""
        return stage_seconds_of(self, n_blocks, a, b, micro_batch, ckpt)

    def optimizer_seconds(self, params: float, total_params: float) -> float:
        """One optimizer step over `params` of the model's `total_params` (a pipeline stage, a shard):
        the kind's whole-model step, measured where a profile has it, in proportion."""
        return self.optimizer_s * params / total_params if total_params > 0 else 0.0

    def time(self, share: int, micro_batch: int, ckpt: bool) -> float:
        """Seconds of one step with `share` samples. A device with none still runs the optimizer step
        (every data-parallel replica updates the whole model), so that is its time."""
        if share <= 0:
            return self.rate.fixed_seconds if self.rate is not None else self.optimizer_s
        factor = cm.CHECKPOINT_COMPUTE_FACTOR if ckpt else 1.0
        if self.rate is not None:  # the balancer's per-step line, as the run measured it
            return self.rate.fixed_seconds + share * self.rate.per_sample_seconds * factor
        if self.measured is not None:
            full, rest = divmod(share, micro_batch)
            t = full * self.measured.microbatch_seconds(self.precision, micro_batch)
            if rest:
                t += self.measured.microbatch_seconds(self.precision, rest)
            return t * factor + self.optimizer_s
        return (math.ceil(share / micro_batch) * self.fixed_s + share * (self.sample_s_ckpt if ckpt else self.sample_s)
                + self.optimizer_s)

    def pieces_time(self, share: int, pieces: int, ckpt: bool) -> float:
        """Seconds of a share run in exactly `pieces` near-equal micro-batches, as every FSDP2 rank runs
        the job's largest count: a piece the share leaves empty runs one stand-in sample."""
        if share <= 0:   # empty pieces, then its shard's optimizer step
            return self.time(0, 1, ckpt) + (pieces * self.fixed_s if self.rate is None and self.measured is None
                                            else 0.0)
        samples = max(share, pieces)
        if self.rate is not None:   # a run's per-step line: samples, not pieces
            return self.time(samples, samples, ckpt)
        if self.measured is not None:
            sizes = split_even(share, pieces)
            factor = cm.CHECKPOINT_COMPUTE_FACTOR if ckpt else 1.0
            return (sum(self.measured.microbatch_seconds(self.precision, max(1, n)) for n in sizes) * factor
                    + self.optimizer_s)
        return pieces * self.fixed_s + samples * (self.sample_s_ckpt if ckpt else self.sample_s) + self.optimizer_s


def measured_optimizer_seconds(measured: DeviceProfile, optimizer: str | None) -> float:
    """A profile's optimizer step for `optimizer`: the profile times torch's default AdamW, and
    another optimizer's step takes the same time per byte it moves (cost_model.OPTIMIZER_STEP_BYTES)."""
    if optimizer is None:
        return measured.optimizer_seconds
    return measured.optimizer_seconds * cm.OPTIMIZER_STEP_BYTES[optimizer] / cm.OPTIMIZER_STEP_BYTES["adamw"]


def stage_seconds_of(kind: Kind, n_blocks: int, a: int, b: int, micro_batch: int, ckpt: bool) -> float | None:
    """Measured seconds of blocks [a, b) for one micro-batch: their part of the model's block time, times
    the whole model's measured time of that micro-batch (interpolated between measured sizes, so the
    fixed cost a small micro-batch pays is kept: scaled linearly from the blocks' profiled size, a
    micro-batch of 1 cost an eighth of one of 8 where the profile measured 0.7 of it); None without a
    profile whose blocks line up with the workload's."""
    m = kind.measured
    if m is None:
        return None
    timed = [x for x in m.blocks if x.precision == kind.precision]
    if len(timed) != n_blocks:
        return None
    per_sample = [x.seconds / x.micro_batch for x in timed]
    if sum(per_sample) > 0 and m.points(kind.precision):
        seconds = sum(per_sample[a:b]) / sum(per_sample) * m.microbatch_seconds(kind.precision, micro_batch)
    else:
        seconds = sum(per_sample[a:b]) * micro_batch
    return seconds * (cm.CHECKPOINT_COMPUTE_FACTOR if ckpt else 1.0)


def _check_model(measured: DeviceProfile, profile: WorkloadProfile, note: str | None) -> str | None:
    """Refuse a device profile of another model (by name, or of the same name by its identity); `note`, with a
    line added for a profile that does not record which model it measured."""
    name = measured.device
    if measured.model != profile.name:
        raise HetrainError(f"the {name} profile measured {measured.model!r}, and the plan is for {profile.name!r}: "
                           f"plan {measured.model!r} with it (--profiles DIR alone plans the workload.json "
                           f"beside it), or profile {profile.name!r} into a fresh directory (hetrain profile --out "
                           "DIR)")
    if measured.workload_id is None:
        line = (f"{name}: its profile does not record which model {measured.model!r} it measured, so timings "
                "of another model of that name would go unnoticed; re-profile into a fresh --out directory (or "
                "pass workload= to measure()) to check")
        return f"{note}; {line}" if note else line
    if measured.workload_id == profile.identity():
        return note
    if profile.inputs is not None and measured.workload_id == profile.identity(inputs=False):
        line = (f"{name}: its profile records the parameters of the model {measured.model!r} it measured, not its "
                "inputs, so timings of other input shapes would go unnoticed; re-profile into a fresh --out "
                "directory to check")
        return f"{note}; {line}" if note else line
    params = f" ({measured.model_params:,} parameters; the plan's has {profile.params:,})" \
        if measured.model_params not in (None, profile.params) else ""
    raise HetrainError(f"the {name} profile measured another model named {measured.model!r}{params} (its "
                       "parameters or inputs differ from the plan's); fix: re-profile this model into a "
                       "fresh directory (hetrain profile --out NEW_DIR) and plan with --profiles NEW_DIR")


def most_on_a_node(cluster, name: str) -> int:
    """The most devices of catalog model `name` on one node of the cluster (ranks that share a host)."""
    return max(sum(g.count for g in node.devices if g.spec.name == name) for node in cluster.nodes)


def kinds_of(cluster, profile: WorkloadProfile, precision: str, calib: cm.Calibration,
             profiles: dict[str, DeviceProfile] | None = None, rates: MeasuredRates | None = None,
             optimizer: str | None = None) -> list[Kind]:
    """Group the cluster's devices by catalog model, with precision and compute figures: a run's
    measured rates where they cover the kind and precision, else a measured profile, else the model
    (with `optimizer`'s step, as a measured profile has its own)."""
    devices = cluster.devices()
    if not devices:
        raise HetrainError("the cluster has no devices; list at least one device in the cluster file")
    kinds: dict[str, Kind] = {}
    for d in devices:
        if d.spec.name not in kinds:
            prec, note = choose_precision(d.spec, precision)
            kind = Kind(
                spec=d.spec, ranks=[], precision=prec, note=note,
                sample_s=cm.sample_seconds(profile, d.spec, prec, calib, False),
                sample_s_ckpt=cm.sample_seconds(profile, d.spec, prec, calib, True),
                fixed_s=cm.fixed_seconds_per_microbatch(profile, d.spec, prec),
                optimizer_s=cm.optimizer_seconds(profile, d.spec, optimizer),
            )
            rate = next((r for r in (rates.devices if rates else []) if r.device == d.spec.name), None)
            measured = (profiles or {}).get(d.spec.name)
            if measured is not None:
                kind.note = _check_model(measured, profile, kind.note)
            if rate is not None and rate.precision == prec:
                kind.rate, kind.source = rate, "measured-run"
            elif measured is not None and prec in measured.precisions():
                kind.measured, kind.source = measured, "measured-profile"
                kind.optimizer_s = measured_optimizer_seconds(measured, optimizer)
            if measured is not None:
                kind.peaks = measured.peak_points(prec) or None
            kinds[d.spec.name] = kind
        kinds[d.spec.name].ranks.append(d.rank)
    for kind in kinds.values():
        if kind.spec.arch == "cpu":   # a node's CPU ranks share its memory
            per_node = most_on_a_node(cluster, kind.spec.name)
            if per_node > 1:
                kind.spec = dataclasses.replace(kind.spec, memory_bytes=kind.spec.memory_bytes // per_node)
                kind.note = ((kind.note + "; ") if kind.note else "") + (
                    f"{kind.spec.name}: {per_node} ranks on a node share its memory, "
                    f"{kind.spec.memory_bytes / 1e9:.1f} GB each")
    host = calib.host_seconds_per_sample.get(profile.kind, 0.0)
    if host > 0 and any(k.source == "measured-profile" for k in kinds.values()):
        # a profile times the model on inputs already in memory: a modelled kind beside it leaves out the
        # published rows' input pipeline too, or the split would favour the profiled kinds by that much (a
        # run's rates count the time its steps waited for data, as the published rows do)
        for kind in kinds.values():
            if kind.source == "modelled":
                kind.sample_s, kind.sample_s_ckpt = kind.sample_s - host, kind.sample_s_ckpt - host
                kind.note = ((kind.note + "; ") if kind.note else "") + (
                    f"{kind.spec.name}: modelled without the {host * 1e6:.0f} us per sample of the published rows' "
                    "input pipeline, as the measured profiles beside it are")
    return list(kinds.values())


def figures_notes(kinds: list[Kind], profile: WorkloadProfile, profiles: dict[str, DeviceProfile] | None,
                  rates: MeasuredRates | None) -> list[str]:
    """One note per device kind: where its speed figures come from."""
    notes = []
    planned = {k.spec.name for k in kinds}
    for r in (rates.devices if rates is not None else []):
        if r.device not in planned:
            notes.append(f"{r.device}: measured in the run, but not among this plan's devices: its rates are unused")
    for name in sorted(set(profiles or {}) - planned):
        notes.append(f"{name}: profiled, but not among this plan's devices: its profile is unused")
    for k in kinds:
        name = k.spec.name
        if k.source == "measured-run":
            r = k.rate
            notes.append(f"{name}: measured in a run (step {rates.step}, {r.ranks} rank(s), "
                         f"{r.per_sample_seconds * 1e3:.3f} ms per sample + {r.fixed_seconds * 1e3:.1f} ms per step"
                         + (", emulated speed" if r.emulated else "") + ")")
        elif k.source == "measured-profile":
            m, s = k.measured, k.measured.stamp
            sizes = ",".join(str(b) for b, _ in m.points(k.precision))
            notes.append(f"{name}: measured profile of {m.model} ({k.precision} at micro-batches {sizes}; "
                         f"{s.device_name}, torch {s.torch}" + (f", CUDA {s.cuda}" if s.cuda else "")
                         + f", {s.date}); interpolated between measured sizes")
            disturbed = m.disturbed_note()
            if disturbed:
                notes.append(disturbed)
            if m.optimizer_seconds and not math.isclose(k.optimizer_s, m.optimizer_seconds):
                notes.append(f"{name}: the profile timed an AdamW step ({m.optimizer_seconds * 1e3:.1f} ms); the plan's "
                             f"optimizer moves other bytes a parameter: {k.optimizer_s * 1e3:.1f} ms")
        else:
            why = ""
            if rates is not None and any(r.device == name for r in rates.devices):
                why = f" (the run measured it in another precision than {k.precision})"
            elif profiles and name in profiles:
                why = f" (its profile has no {k.precision} timings)"
            notes.append(f"{name}: modelled by the cost model{why}")
            off = caveat(name, profile.kind, k.precision)
            if off:
                notes.append(off)
        if k.peaks:
            notes.append(f"{name}: activation memory measured (peaks at micro-batches "
                         f"{','.join(str(b) for b, _ in k.peaks)}), weights, gradients and optimizer state modelled")
        elif profiles and name in profiles:
            notes.append(f"{name}: memory modelled (its profile has no {k.precision} peak memory; "
                         "peaks are measured on CUDA devices)")
    return notes


def cpu_sharing_notes(kinds: list[Kind], cluster) -> list[str]:
    """A CPU profile times a step with its stamp's threads, as its `concurrent_copies` copies shared
    the machine. `hetrain launch` gives each of N ranks on a node, GPU ranks included, the cores / N
    threads (OMP_NUM_THREADS, where not set): where the plan's ranks of that kind on a node, or the
    threads each gets on this machine, differ from the profile's, the note says how to profile for the plan."""
    notes = []
    for k in kinds:
        if k.source != "measured-profile" or k.spec.arch != "cpu":
            continue
        # the node with the most of these CPU ranks (then the most ranks): launch splits its cores over all its ranks
        per_node, on_node = max((sum(g.count for g in node.devices if g.spec.name == k.spec.name), node.size)
                                for node in cluster.nodes)
        threads = rank_threads(on_node)
        stamp = k.measured.stamp
        if per_node == stamp.concurrent_copies and stamp.threads in (None, threads):
            continue
        copies = "1 copy" if stamp.concurrent_copies == 1 else f"{stamp.concurrent_copies} copies"
        each = f", {stamp.threads} thread(s) each" if stamp.threads else ""
        beside = f" beside {on_node - per_node} other rank(s)" if on_node > per_node else ""
        notes.append(f"{k.spec.name}: the profile timed {copies} at once{each}; this plan runs {per_node} rank(s) on "
                     f"a node{beside}, {threads} thread(s) each on this machine, so its step times may be far off; "
                     f"profile with `hetrain profile --device cpu --concurrent {per_node} --threads {threads}`")
    return notes


def extrapolation_notes(kinds: list[Kind], ranks) -> list[str]:
    """A measured kind whose ranks (the plan's RankPlans) run micro-batches outside the sizes its
    profile timed: those times come from the line through the two nearest sizes, not from a
    measurement; the note names the sizes to add."""
    notes = []
    for k in kinds:
        if k.source != "measured-profile":
            continue
        timed = sorted(b for b, _ in k.measured.points(k.precision))
        used = set()
        for r in ranks:
            if r.device != k.spec.name or r.share <= 0 or r.micro_batch <= 0:
                continue
            used.add(min(r.micro_batch, r.share))
            if r.share > r.micro_batch and r.share % r.micro_batch:
                used.add(r.share % r.micro_batch)
        outside = sorted(b for b in used if b < timed[0] or b > timed[-1])
        if not outside:
            continue
        sizes = ", ".join(str(b) for b in outside)
        both = ",".join(str(b) for b in sorted(set(timed) | set(outside)))
        notes.append(f"{k.spec.name}: micro-batch {sizes} lies outside the sizes its profile timed "
                     f"({timed[0]}-{timed[-1]}), so its time is extrapolated from the nearest measured sizes; "
                     f"measure it with `hetrain profile ... --micro-batches {both}`")
    return notes
