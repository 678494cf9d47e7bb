"""`hetrain bench memory`: what each memory strategy holds per rank, measured, and what it fits, predicted.

Measured on CPU ranks over gloo (spawned here): per rank, optimizer-state bytes after one Adam step
and the bytes a forward keeps for backward, for sharding none, zero1, zero1-proportional and fsdp,
each with and without activation checkpointing, on a small transformer. Memory capacities for the
proportional split come from the plan (an A100-80GB and V100-32GB pattern), as on a mixed cluster.
Predicted by the cost model: the largest model each approach fits on the `a100x4+v100x4` preset.
"""

from __future__ import annotations

import argparse
import time

from hetrain.bench.args import whole
from hetrain.errors import HetrainError
from hetrain.vocabulary import SHARDINGS

CAPACITY_PATTERN = (80 * 10**9, 32 * 10**9)  # a100-sxm4-80gb, v100-sxm2-32gb (from the plan, emulated)


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=whole(1), default=3, help="CPU ranks to spawn (2 or 3)")
    parser.add_argument("--width", type=whole(1), default=64, help="transformer width")
    parser.add_argument("--depth", type=whole(1), default=6, help="transformer blocks")
    parser.add_argument("--seq", type=whole(1), default=32, help="tokens per sample")
    parser.add_argument("--global-batch-size", "--global-batch", dest="global_batch_size", type=whole(1), default=12,
                        help="samples per step, split over the ranks")
    parser.add_argument("--preset", default="a100x4+v100x4", help="cluster for the largest-model report")


def _share_errors(strategies: dict, world: int, params_bytes: int) -> dict:
    total = sum(strategies["none"]["optimizer_state_bytes"]) / world
    caps = [CAPACITY_PATTERN[r % 2] - 2 * params_bytes for r in range(world)]
    targets = {"zero1": [1 / world] * world, "zero1-proportional": [c / sum(caps) for c in caps]}
    out = {}
    for name, target in targets.items():
        got = strategies[name]["optimizer_state_bytes"]
        out[name] = {"share": [g / total for g in got], "target": target,
                     "worst_relative_error": max(abs(g / total - t) / t for g, t in zip(got, target))}
    return out


# ---------------------------------------------------------------- predicted: largest model per approach


def transformer_of_layers(layers: int, hidden: int = 4096, heads: int = 32, seq: int = 2048, vocab: int = 32000):
    from hetrain.workload.zoo import ModelFacts, transformer_profile

    params = 12 * layers * hidden * hidden + vocab * hidden
    facts = ModelFacts(model="transformer-h4096", params=params, seq_len=seq, forward_flops=2.0 * params * seq,
                       layers=layers, hidden=hidden, heads=heads, vocab=vocab)
    return transformer_profile(f"transformer-h{hidden}-l{layers}", facts)


def _fits(approach: str, profile, devices: list[tuple[str, int]]) -> bool:
    from hetrain.planning import cost_model as cm

    world = len(devices)
    if approach in ("none", "zero1", "fsdp"):
        zero = {"none": 0, "zero1": 1, "fsdp": 3}[approach]
        return all(cm.memory_estimate(profile, prec, 1, zero=zero, world=world, checkpointing=True).total <= cap
                   for prec, cap in devices)
    # zero1-proportional: rank r can hold a fraction f_r of the optimizer state; the fractions must cover it,
    # and every device must hold the rest (weights, gradients, activations) with no state at all.
    covered = 0.0
    for prec, cap in devices:
        est = cm.memory_estimate(profile, prec, 1, zero=0, world=world, checkpointing=True)
        context = est.overhead - cm.FRAGMENTATION * (est.weights + est.gradients + est.optimizer
                                                     + max(est.activations, est.step_temporaries))

        def peak(f: float) -> float:   # holding a fraction f of the state (and of the step's temporaries)
            held = est.weights + est.gradients + f * est.optimizer + max(est.activations, f * est.step_temporaries)
            return held * (1 + cm.FRAGMENTATION) + context

        if peak(0.0) > cap:
            return False
        lo, hi = 0.0, 1.0
        if peak(1.0) <= cap:
            lo = 1.0
        else:
            for _ in range(40):
                lo, hi = ((lo + hi) / 2, hi) if peak((lo + hi) / 2) <= cap else (lo, (lo + hi) / 2)
        covered += lo
    return covered >= 1.0 - 1e-9


def largest_models(preset: str = "a100x4+v100x4") -> dict:
    """By the cost model: the most parameters each approach fits (AdamW, micro-batch 1, checkpointing on)."""
    from hetrain.hardware.cluster import get_preset
    from hetrain.planning.precision_policy import choose_precision

    cluster = get_preset(preset)
    devices = [(choose_precision(d.spec)[0], d.spec.memory_bytes) for d in cluster.devices()]
    out = {}
    for approach in SHARDINGS:
        lo, hi = 0, 4096  # layers of a hidden-4096 transformer (seq 2048, vocab 32000)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if _fits(approach, transformer_of_layers(mid), devices) else (lo, mid - 1)
        out[approach] = {"layers": lo, "params_billion": round(transformer_of_layers(lo).params / 1e9, 2) if lo else 0.0}
    base = out["zero1"]["params_billion"]
    for approach in out:
        out[approach]["ratio_to_zero1"] = round(out[approach]["params_billion"] / base, 3) if base else None
    return {"preset": preset, "devices": [f"{d.spec.name} ({p})" for d, (p, _) in zip(cluster.devices(), devices)],
            "family": "transformer, hidden 4096, 32 heads, seq 2048, vocab 32000; AdamW; micro-batch 1; "
                      "activation checkpointing on", "approaches": out}


def run(args: argparse.Namespace) -> dict:
    if args.ranks not in (2, 3):
        raise HetrainError(f"--ranks {args.ranks}: this benchmark runs 2 or 3 CPU ranks")
    if args.global_batch_size < args.ranks:
        raise HetrainError(f"--global-batch-size {args.global_batch_size} is smaller than the {args.ranks} ranks; "
                           f"use at least {args.ranks}")
    from hetrain.hardware.cluster import get_preset

    get_preset(args.preset)   # an unknown --preset is refused before any rank starts
    from hetrain.bench.memory_job import measured, parameters   # torch: after the flags are checked

    t0 = time.perf_counter()
    strategies = measured(args)
    wall = time.perf_counter() - t0
    params_bytes = 4 * parameters(args.width, args.depth)
    ckpt_ratio = {s: sum(strategies[f"{s}+ckpt"]["saved_activation_bytes"]) / sum(strategies[s]["saved_activation_bytes"])
                  for s in SHARDINGS}
    shares = _share_errors(strategies, args.ranks, params_bytes // 4 * 4)
    return {
        "ranks": args.ranks,
        "model": f"transformer width {args.width}, {args.depth} blocks, seq {args.seq} "
                 f"({params_bytes // 4} parameters), Adam, global batch {args.global_batch_size}",
        "capacities_from_plan": [CAPACITY_PATTERN[r % 2] for r in range(args.ranks)],
        "per_rank": strategies,
        "optimizer_state_shares": shares,
        "checkpointing_saved_bytes_ratio": ckpt_ratio,
        "largest_model": largest_models(args.preset),
        "checks": {
            "zero1_within_10pct": shares["zero1"]["worst_relative_error"] <= 0.10,
            "zero1_proportional_within_10pct": shares["zero1-proportional"]["worst_relative_error"] <= 0.10,
            "checkpointing_halves_activations": all(r <= 0.5 for r in ckpt_ratio.values()),
        },
        "wall_s": wall,
        "emulated": "memory capacities come from the plan; CPU ranks",
    }
