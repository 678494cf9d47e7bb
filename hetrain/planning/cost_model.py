"""Predicted time and memory of one training step: pure functions, no processes.

Compute, per sample: the step's FLOPs at the peak of the precision the math units run in (lower on
power-limited parts, and by a fitted efficiency for transformers in TF32 and fp32), plus its memory
traffic (fitted passes over the activation bytes) at the device's bandwidth, less what its L2 cache
keeps on chip, with a fitted factor for graphics-memory (GDDR) parts against HBM datacenter parts,
plus a fitted per-image host time for CNNs; per micro-batch, the weights read and gradients written
once plus kernel launches; per step, the optimizer's pass over weights, gradients and state. "fp32"
on Ampere and later runs convolutions in TF32 unless TF32 is turned off.
Memory: weights, gradients, optimizer state (ZeRO stages divide what they shard), activations per
micro-batch (or only block boundaries with activation checkpointing), framework overhead.
Communication: ring or two-level all-reduce over the slowest link, partly hidden under backward.
Pipelines: the slowest stage times (m + p - 1) micro-batches (the (p-1)/m bubble of GPipe/1F1B), or
m + (p-1)/v with v chunks per rank (interleaved 1F1B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from hetrain.workload.profile import WorkloadProfile

ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2}
PRECISION_CLASS = {"fp32": "fp32", "tf32": "tf32", "fp16": "16bit", "bf16": "16bit"}
_CLASS_FALLBACK = {"tf32": "16bit", "16bit": "tf32", "fp32": "tf32"}  # a group without rows
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adamw-fused": 8, "adam-fused": 8, "sgd": 4, "sgd-fused": 4,
                         "lion": 4, "sgd-nomomentum": 0}
# Bytes per parameter an optimizer step moves through memory, once per step. A fused step reads fp32
# weights, gradients and state once and writes weights and state once (Adam: w, g, m, v in, w, m, v out;
# SGD with momentum or Lion: w, g, buffer in, w, buffer out; plain SGD: w, g in, w out). torch.optim's
# default on GPUs is the multi-tensor step, one pass over memory per operation: AdamW's weight decay (8),
# the first moment's lerp (12), the second's mul and addcmul (8 + 12), the sqrt, bias-correction divide
# and epsilon add (8 each) and the update's addcdiv (16), 80 (Adam, without the decay, 72); SGD's
# momentum mul and add and the update (8 + 12 + 12), 32.
OPTIMIZER_STEP_BYTES = {"adamw": 80, "adam": 72, "adamw-fused": 28, "adam-fused": 28, "sgd": 32, "sgd-fused": 20,
                        "lion": 20, "sgd-nomomentum": 12}
# Bytes per parameter an optimizer step allocates while it runs: the multi-tensor Adam step takes the
# square root of every second moment at once (torch.optim's docs: about sizeof(params) more peak memory
# than a per-tensor loop). Activations are freed by then, so the step's peak replaces theirs.
OPTIMIZER_STEP_TEMP_BYTES = {"adamw": 4, "adam": 4}
CHECKPOINT_COMPUTE_FACTOR = 4.0 / 3.0  # recomputing the forward adds a third of forward+backward
LAUNCH_SECONDS_PER_MICROBATCH = 0.5e-3
CONTEXT_BYTES = 1 << 30  # CUDA context, cuBLAS/cuDNN workspaces
FRAGMENTATION = 0.10  # allocator slack on top of what tensors hold
LINK_EFFICIENCY = 0.8  # collectives reach about this fraction of a link's one-way peak
LATENCY_INTRA_S = 5e-6
LATENCY_INTER_S = 20e-6
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Calibration:
    """Fitted constants of the compute model (see hetrain.planning.calibration)."""

    compute_efficiency: dict[str, float] = field(hash=False)
    """fraction of peak FLOP/s reached, keyed "kind/class" (cnn|transformer, 16bit|tf32|fp32)"""
    memory_passes: dict[str, float] = field(hash=False)
    """times each activation byte crosses memory per sample, by workload kind (elementwise traffic)"""
    graphics_memory_efficiency: float = 1.0
    """bandwidth reached by GDDR graphics dies (RTX, A10, L4, T4) relative to HBM datacenter dies"""
    l2_scale_bytes: float = math.inf
    """an L2 cache of this size halves the activation traffic reaching memory (traffic / (1 + L2 / this))"""
    power_exponent: float = 0.0
    """a part with less power per peak FLOP than its die family's best runs its arithmetic at
    (its power / the best's) ** this of its quoted peak (see power_fraction)"""
    host_seconds_per_sample: dict[str, float] = field(default_factory=dict, hash=False)
    """per-sample time that does not depend on the device, by workload kind (input pipeline)"""
    packed_token_fraction: float = 1.0
    """tokens per sequence over nominal in the published BERT-512 recipe (unpadded packing)"""
    scaling_per_doubling: float = 1.0
    """data-parallel throughput kept per doubling of replicas beyond the modelled all-reduce
    (synchronisation, stragglers, input pipelines), fitted on published multi-GPU rows"""
    rows: int = 0
    parameters: int = 0

    def efficiency(self, kind: str, precision: str) -> float:
        """Fraction of peak for a workload kind in a precision ("other": geometric mean of both kinds)."""
        if kind == "other":
            return math.sqrt(self.efficiency("cnn", precision) * self.efficiency("transformer", precision))
        cls = PRECISION_CLASS[precision]
        for c in (cls, _CLASS_FALLBACK[cls], "16bit"):
            if f"{kind}/{c}" in self.compute_efficiency:
                return self.compute_efficiency[f"{kind}/{c}"]
        return min(self.compute_efficiency.values())

    def passes(self, kind: str) -> float:
        """Memory passes over the activation bytes for a workload kind ("other": geometric mean)."""
        if kind in self.memory_passes:
            return self.memory_passes[kind]
        return math.exp(sum(math.log(v) for v in self.memory_passes.values()) / len(self.memory_passes))


def default_calibration() -> Calibration:
    """The calibration fitted on hetrain/data/published_training.csv (hetrain.planning.calibration, which
    imports this module: reached through here by the cost model's own functions)."""
    from hetrain.planning.calibration import default_calibration as fitted

    return fitted()


def peak_flops(spec, precision: str) -> float:
    """The device's peak FLOP/s in `precision` (fp32 where the chip lacks it)."""
    peak = spec.peak_flops.get(precision, 0.0) or 0.0
    return peak if peak > 0 else spec.peak_flops["fp32"]


def math_precision(spec, precision: str, kind: str, fp32_math: str = "fp32") -> str:
    """The precision the math units run in for a requested `precision`.

    `fp32_math` says what the software stack does with fp32 on Ampere and later: "fp32" (TF32 off,
    as hetrain's runtime sets it), "default" (PyTorch's default: cuDNN convolutions in TF32, matmuls
    in fp32) or "tf32" (both in TF32, as NVIDIA's NGC containers do).
    """
    if precision != "fp32" or spec.compute_capability < (8, 0) or spec.arch == "cpu":
        return precision
    if fp32_math == "tf32" or (fp32_math == "default" and kind == "cnn"):
        return "tf32"
    return "fp32"


def graphics_memory(spec) -> bool:
    """GDDR graphics dies (compute capability x.5-x.9: T4, A10, RTX, L4) against HBM x.0 datacenter dies."""
    return spec.arch != "cpu" and spec.compute_capability[1] != 0


@lru_cache(maxsize=None)
def _family_watts_per_flop(precision: str) -> dict[tuple[str, bool], float]:
    """Power per peak FLOP/s at `precision` of each die family's reference parts (gpus.csv's
    power_reference)."""
    from hetrain.hardware.catalog import load_catalog

    best: dict[tuple[str, bool], float] = {}
    for spec in load_catalog().values():
        if spec.tdp_w and spec.arch != "cpu" and spec.power_reference and spec.peak_flops.get(precision):
            key = (spec.arch, graphics_memory(spec))
            best[key] = max(best.get(key, 0.0), spec.tdp_w / spec.peak_flops[precision])
    return best


def power_fraction(spec, precision: str = "fp32") -> float:
    """The part's power limit per peak FLOP/s of the units a step at `precision` (its math precision)
    runs on, over that of its die family's reference part (same architecture and memory kind: A10
    against RTX 3090, A100 PCIe against A100 SXM): below 1 the part cannot hold the clock its peaks
    are quoted at under sustained load. A professional part whose tensor cores run FP32 accumulation
    at full rate has twice a GeForce part's tensor peak on the same power, and is that much further
    from holding it. 1 where unknown, for a family without a reference part, and for lower bins that
    draw more per FLOP than the reference."""
    if not spec.tdp_w or spec.arch == "cpu":
        return 1.0
    basis = precision if spec.peak_flops.get(precision) else "fp32"   # no such units: the fp32 ones
    best = _family_watts_per_flop(basis).get((spec.arch, graphics_memory(spec)))
    return min(1.0, spec.tdp_w / spec.peak_flops[basis] / best) if best else 1.0


def data_parallel_efficiency(replicas: int, calib: Calibration | None = None) -> float:
    """Fraction of the modelled data-parallel speed that `replicas` replicas keep (1 for one)."""
    calib = calib or default_calibration()
    return calib.scaling_per_doubling ** math.log2(replicas) if replicas > 1 else 1.0


# ---------------------------------------------------------------- compute


def per_sample_terms(profile: WorkloadProfile, spec, precision: str) -> tuple[float, float]:
    """(FLOP seconds at 100% efficiency, seconds per activation-byte pass at peak bandwidth) for one sample."""
    act = profile.activation_bytes(ELEMENT_BYTES[precision])
    return profile.flops_per_sample / peak_flops(spec, precision), act / spec.mem_bw_bytes_per_s


def fixed_seconds_per_microbatch(profile: WorkloadProfile, spec, precision: str) -> float:
    """Per micro-batch: read fp32 weights in forward and backward, write gradients, launch kernels."""
    return parameter_pass_seconds(3 * 4, profile, spec) + LAUNCH_SECONDS_PER_MICROBATCH


def parameter_pass_seconds(bytes_per_param: float, profile: WorkloadProfile, spec) -> float:
    """Seconds to move `bytes_per_param` bytes for every parameter through the device's memory."""
    return bytes_per_param * profile.params / spec.mem_bw_bytes_per_s


def optimizer_seconds(profile: WorkloadProfile, spec, optimizer: str | None) -> float:
    """Per step: the optimizer's pass over weights, gradients and state at the device's memory bandwidth
    (0 without an optimizer named). The same on every rank of a kind, whatever its share."""
    if optimizer is None:
        return 0.0
    # over the trained parameters only: a frozen one has no gradient, and torch's optimizers skip it (as
    # parameter_pass_seconds's product, so a model training all its parameters gets its figure to the last bit)
    return OPTIMIZER_STEP_BYTES[optimizer] * profile.trained_params / spec.mem_bw_bytes_per_s


def sample_seconds(profile: WorkloadProfile, spec, precision: str, calib: Calibration | None = None,
                   checkpointing: bool = False, fp32_math: str = "fp32") -> float:
    """Predicted compute seconds per sample (large micro-batch), forward + backward."""
    calib = calib or default_calibration()
    math_p = math_precision(spec, precision, profile.kind, fp32_math)
    flop_s, byte_s = per_sample_terms(profile, spec, math_p)
    bw = (calib.graphics_memory_efficiency if graphics_memory(spec) else 1.0) * (1.0 + spec.l2_bytes / calib.l2_scale_bytes)
    flop_s *= power_fraction(spec, math_p) ** -calib.power_exponent
    t = flop_s / calib.efficiency(profile.kind, math_p) + calib.passes(profile.kind) * byte_s / bw
    return t * (CHECKPOINT_COMPUTE_FACTOR if checkpointing else 1.0) + calib.host_seconds_per_sample.get(profile.kind, 0.0)


def compute_seconds(profile: WorkloadProfile, spec, precision: str, share: int, micro_batch: int,
                    checkpointing: bool = False, calib: Calibration | None = None, fp32_math: str = "fp32",
                    optimizer: str | None = None) -> float:
    """Predicted compute seconds of one step: `share` samples in micro-batches of `micro_batch`, then the
    step of `optimizer` (none when not named)."""
    if share <= 0:
        return 0.0
    steps = math.ceil(share / max(1, micro_batch))
    return steps * fixed_seconds_per_microbatch(profile, spec, precision) + share * sample_seconds(
        profile, spec, precision, calib, checkpointing, fp32_math
    ) + optimizer_seconds(profile, spec, optimizer)


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak bytes on one device, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float
    step_temporaries: float = 0.0
    """what the optimizer step allocates while it runs, after backward has freed the activations"""
    weight_casts: float = 0.0
    """16-bit casts of weights that backward keeps, freed with the activations (sharded FSDP2 weights only:
    see `weight_cast_bytes`)"""

    @property
    def total(self) -> int:
        held = max(self.activations + self.weight_casts, self.step_temporaries)
        return int(math.ceil(self.weights + self.gradients + self.optimizer + held + self.overhead))


def activation_bytes_per_sample(profile: WorkloadProfile, precision: str, checkpointing: bool,
                                blocks: slice | None = None) -> float:
    """Bytes held for backward per sample; with checkpointing, block inputs plus the largest block."""
    elem = ELEMENT_BYTES[precision]
    scale = elem / profile.activation_dtype_bytes
    chosen = profile.blocks[blocks] if blocks is not None else profile.blocks
    if not chosen:
        return profile.activation_bytes(elem)
    if not checkpointing:
        if blocks is None:
            return profile.activation_bytes(elem)
        return sum(b.activation_bytes_per_sample for b in chosen) * scale
    return (sum(b.output_bytes_per_sample for b in chosen) + max(b.activation_bytes_per_sample for b in chosen)) * scale


def state_bytes(params: float, precision: str, optimizer: str, zero: int = 0, world: int = 1,
                largest_block_params: float = 0.0, trained: float | None = None,
                checkpointing: bool = False, largest_block_trained: float | None = None,
                pipelined: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes: fp32 master weights, a 16-bit cast cache in mixed
    precision, fp32 gradients; ZeRO-1 shards optimizer state, 2 also gradients, 3 also weights.
    Gradients and optimizer state are of the `trained` parameters (all `params` by default): a frozen
    one has neither. ZeRO-3 (FSDP2) shards fp32 weights only and gathers a block and the next one in
    fp32; with activation checkpointing the running block's 16-bit casts too (the prefetched one has
    none yet), without it `weight_cast_bytes` counts the casts of every weight. In backward it also
    holds a block's unsharded fp32 gradients and the reduce-scatter's input of them (of `largest_block_trained`, by default the largest block's
    parameters). `pipelined`: a pipeline stage under ZeRO-3, which torch's PipelineStage runs with
    `set_reshard_after_backward(False)` and `set_requires_gradient_sync(False)` in every micro-batch's
    backward and reduce-scatters once after the last: through a step the stage holds all its weights
    gathered in fp32 beside their shard, and all its gradients unsharded beside the reduce-scatter's
    sharded output; only the optimizer state stays sharded."""
    opt = OPTIMIZER_STATE_BYTES[optimizer]
    cast = 2.0 if ELEMENT_BYTES[precision] == 2 else 0.0
    world = max(1, world)
    trained = params if trained is None else trained
    weights = (4.0 + cast) * params
    grads = 4.0 * trained
    optim = opt * trained
    if zero >= 1:
        optim /= world
    if zero >= 2:
        grads /= world
    if zero >= 3 and pipelined:   # the fp32 shard and every weight gathered; every gradient unsharded
        weights = 4.0 * params / world + 4.0 * params + (cast if checkpointing else 0.0) * largest_block_params
        grads += 4.0 * trained
    elif zero >= 3:   # the fp32 shard, then the gathered block and the prefetched one
        weights = 4.0 * params / world + (2 * 4.0 + (cast if checkpointing else 0.0)) * largest_block_params
        grads += 2 * 4.0 * (largest_block_params if largest_block_trained is None else largest_block_trained)
    return weights, grads, optim


def weight_cast_bytes(params: float, precision: str, zero: int, checkpointing: bool) -> float:
    """16-bit casts of weights kept for backward beyond `state_bytes`'s: under ZeRO-3 (FSDP2) without activation
    checkpointing, every gathered weight's cast, 2 bytes a parameter held. autocast casts each gathered fp32
    weight as an op uses it (hetrain's autocast keeps no cache of them under FSDP2) and the op saves the
    cast for backward, so by the forward's end a rank holds a 16-bit copy of all it computes with, not a
    shard of one (1.87 bytes a parameter of the model measured over 2 and 4 CPU ranks, its 2-D weights'
    share). With checkpointing a block's casts live while it is recomputed."""
    if zero < 3 or checkpointing or ELEMENT_BYTES[precision] != 2:
        return 0.0
    return 2.0 * params


def memory_estimate(profile: WorkloadProfile, precision: str, micro_batch: int, *, optimizer: str = "adamw",
                    zero: int = 0, world: int = 1, checkpointing: bool = False,
                    blocks: slice | None = None, in_flight: int = 1,
                    activations: float | None = None, pipelined: bool = False) -> MemoryEstimate:
    """Predicted peak memory of one device training `blocks` (all by default) at `micro_batch`.

    `in_flight` micro-batches keep their activations at once (pipeline stages under 1F1B).
    `activations`: the bytes one micro-batch holds for backward as a device profile measured them,
    in place of the modelled ones. `pipelined`: a pipeline stage (see `state_bytes`).
    """
    chosen = profile.blocks[blocks] if blocks is not None else profile.blocks
    if blocks is not None:
        start, stop, _ = blocks.indices(len(profile.blocks))
        params = profile.held_params(start, stop)
        trained = profile.held_trained_params(start, stop)
        largest = max((profile.held_params(i, i + 1) for i in range(start, stop)), default=params)
        largest_trained = max((profile.held_trained_params(i, i + 1) for i in range(start, stop)), default=trained)
    else:
        params, trained = profile.params, profile.trained_params
        largest = max((b.params for b in chosen), default=params)
        largest_trained = max((b.trained_params for b in chosen), default=trained)
    w, g, o = state_bytes(params, precision, optimizer, zero, world, largest, trained, checkpointing, largest_trained,
                          pipelined)
    if activations is None:
        activations = activation_bytes_per_sample(profile, precision, checkpointing, blocks) * micro_batch
    act = activations * in_flight
    casts = weight_cast_bytes(params, precision, zero, checkpointing) * in_flight   # each micro-batch its own
    step = OPTIMIZER_STEP_TEMP_BYTES.get(optimizer, 0) * trained / (max(1, world) if zero >= 1 else 1)
    return MemoryEstimate(w, g, o, act, CONTEXT_BYTES + FRAGMENTATION * (w + g + o + max(act + casts, step)), step,
                          casts)


# ---------------------------------------------------------------- communication


@dataclass(frozen=True)
class CommTopology:
    """What an all-reduce crosses: nodes of devices, the slowest link inside a node, the network."""

    node_sizes: tuple[int, ...]
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    host_staged: bool = False
    """a node's devices exchange data through host memory (no peer-to-peer access): see `hidden_seconds`"""

    @property
    def world(self) -> int:
        return sum(self.node_sizes)


def topology_of(cluster, ranks: list[int] | None = None) -> CommTopology:
    """The CommTopology of `ranks` (all by default) of a hetrain.hardware Cluster."""
    devices = cluster.devices()
    if ranks is not None:
        wanted = set(ranks)
        devices = [d for d in devices if d.rank in wanted]
    nodes: dict[object, list] = {}
    for d in devices:
        nodes.setdefault(d.node, []).append(d)
    shared = [d for group in nodes.values() if len(group) > 1 for d in group]
    intra = [d.intra_bytes_per_s or d.spec.pcie_bytes_per_s or 16e9 for d in shared]
    return CommTopology(
        node_sizes=tuple(len(g) for g in nodes.values()),
        intra_bytes_per_s=min(intra) if intra else float("inf"),
        inter_bytes_per_s=float(cluster.inter_node_bytes_per_s or 12.5e9),
        host_staged=any(d.host_staged for d in shared),
    )


def ring_seconds(nbytes: float, n: int, bytes_per_s: float, latency: float, factor: float = 2.0) -> float:
    """Ring collective time: factor*(n-1)/n of the payload over the link (2 for all-reduce,
    1 for reduce-scatter, all-gather, reduce or broadcast), plus per-hop latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return factor * (n - 1) / n * nbytes / (bytes_per_s * LINK_EFFICIENCY) + factor * (n - 1) * latency


@dataclass(frozen=True)
class AllReduceCost:
    """Predicted all-reduce time, the algorithm picked, and the part spent on the network."""

    seconds: float
    algorithm: str
    inter_node_seconds: float


def allreduce_cost(nbytes: float, topo: CommTopology, factor: float = 2.0) -> AllReduceCost:
    """Flat ring over all ranks or two-level (inside nodes, then across nodes), whichever is faster. A flat ring
    over several nodes runs at its slowest link: the network between nodes, or inside a node (a ring through
    every rank crosses each node's own links too, PCIe where it is slower than the network)."""
    n, nodes = topo.world, len(topo.node_sizes)
    if n <= 1 or nbytes <= 0:
        return AllReduceCost(0.0, "none", 0.0)
    if nodes == 1:
        return AllReduceCost(ring_seconds(nbytes, n, topo.intra_bytes_per_s, LATENCY_INTRA_S, factor), "ring", 0.0)
    slowest = min(topo.inter_bytes_per_s, topo.intra_bytes_per_s)
    flat_inter = ring_seconds(nbytes, n, slowest, LATENCY_INTER_S, factor)
    k = max(topo.node_sizes)
    inside = 2 * ring_seconds(nbytes, k, topo.intra_bytes_per_s, LATENCY_INTRA_S, factor / 2) if k > 1 else 0.0
    across = ring_seconds(nbytes, nodes, topo.inter_bytes_per_s, LATENCY_INTER_S, factor)
    if inside + across < flat_inter:
        return AllReduceCost(inside + across, "two-level", across)
    return AllReduceCost(flat_inter, "ring", flat_inter)


def hidden_seconds(topo: CommTopology, compute_seconds: float) -> float:
    """The compute a collective over `topo` can hide under: all of it, except where a node's devices
    exchange data through host memory. There the collective is modelled as exposed: the published
    2-GPU BERT-large rows of the RTX 3090 and 4090 (hetrain/data/published_training.csv, lambda-2023)
    keep 63-86% of twice their single GPU's speed, where an all-reduce hidden under backward, even at
    half of PCIe's bandwidth, would leave over 95% (docs/cost-model.md)."""
    return 0.0 if topo.host_staged else compute_seconds


def exposed_seconds(comm_seconds: float, backward_seconds: float, total_bytes: float,
                    bucket_bytes: float = DEFAULT_BUCKET_BYTES) -> float:
    """Communication left after overlapping with backward: all but the last bucket can hide."""
    if comm_seconds <= 0:
        return 0.0
    last_bucket = comm_seconds * min(1.0, bucket_bytes / max(total_bytes, 1.0))
    return max(comm_seconds - backward_seconds, last_bucket)


def backward_fraction(checkpointing: bool) -> float:
    """Share of a micro-batch's compute spent in backward (2/3; recomputation runs in backward too)."""
    return (2.0 + (1.0 if checkpointing else 0.0)) / (3.0 + (1.0 if checkpointing else 0.0))


def pipeline_chunk_slots(stages: int, microbatches: int, chunks: int = 1) -> int:
    """Chunk-sized slots of an interleaved 1F1B step over p ranks with v chunks each (a slot: one
    micro-batch through one chunk), as torch's schedule runs them: each of the v rounds takes
    max(m, p) slots, as a micro-batch is back at the first rank p slots after it left, then the
    last round drains, (v-1)*max(m, p) + m + p - 1; v*m + p - 1 when m >= p, and GPipe's and
    1F1B's m + p - 1 for v = 1."""
    p, m, v = stages, microbatches, chunks
    return (v - 1) * max(m, p) + m + p - 1


def pipeline_step_seconds(stage_seconds: list[float], microbatches: int, p2p_seconds: float = 0.0,
                          chunks: int = 1) -> float:
    """GPipe/1F1B step over p ranks (`stage_seconds`: each rank's compute of one micro-batch): (m + p - 1)
    slots of the slowest rank, plus one transfer per slot (bubble (p-1)/(m+p-1)). Interleaved 1F1B
    with `chunks` = v stages per rank runs pipeline_chunk_slots chunk-sized slots, m + (p-1)/v rank
    slots when m >= p, each with v transfers (bubble (p-1)/(v*m + p-1))."""
    p = len(stage_seconds)
    slot = max(stage_seconds) + chunks * p2p_seconds
    return pipeline_chunk_slots(p, microbatches, chunks) / chunks * slot


def pipeline_bubble(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The idle fraction of a GPipe or 1F1B step over p ranks with equal stages, (p - 1) / (m + p - 1);
    of interleaved 1F1B with v chunks per rank, (p - 1) / (v * m + p - 1) when m >= p, and
    1 - v*m / (v*p + m - 1) with fewer micro-batches than ranks."""
    return 1.0 - chunks * microbatches / pipeline_chunk_slots(stages, microbatches, chunks)


def sharded_stage_gathers(microbatches: int) -> int:
    """All-gathers of each block's weights in one step of a pipeline stage sharded over its replicas
    (FSDP2), m + 1: a forward reshards the weights after it, a backward keeps them (torch's PipelineStage
    sets `set_reshard_after_backward(False)` until the last), so each warm-up forward (w of them) and each
    backward that follows a forward (m - w + 1) gathers, and an op that follows a backward finds them
    gathered; whatever the stage's place, GPipe, 1F1B or interleaved (counted on CPU ranks in
    tests/pipeline/test_sharded_stage_gathers.py)."""
    return microbatches + 1
