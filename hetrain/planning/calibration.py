"""Fit the compute model's few constants on published single-GPU rows, and hold the model against
rows it never saw: every row of a source predicted by a fit on the other sources only, and every
row of a GPU kind by a fit without that kind.

Fitted (see cost_model.sample_seconds): the efficiencies of transformers in TF32 and fp32, bounded
to (0, 1] of peak (the others sit at peak); memory passes over the activation bytes per workload
kind; the bandwidth GDDR graphics dies reach relative to HBM datacenter dies; the L2 size that
halves the traffic reaching memory; the exponent of power-limited parts (cost_model.power_fraction);
the per-image host time of CNNs; the token fraction of the published BERT-512 recipe (it packs
unpadded sequences). Each source's software stack runs a
workload kind at its own overall speed (NVIDIA's ResNet-50 recipe with DALI and channels-last is
about 1.5x Lambda's on the same A100), so each (source, kind) gets a level factor, constrained to a
geometric mean of 1: the shared constants then describe how GPU kinds differ, and a prediction for
an unseen stack uses the mean level. The device's own peaks and bandwidth carry the rest.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import statistics
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

import numpy as np

from hetrain.planning.cost_model import (
    PRECISION_CLASS,
    Calibration,
    CommTopology,
    allreduce_cost,
    backward_fraction,
    compute_seconds,
    data_parallel_efficiency,
    exposed_seconds,
    fixed_seconds_per_microbatch,
    hidden_seconds,
    optimizer_seconds,
    parameter_pass_seconds,
    graphics_memory,
    math_precision,
    per_sample_terms,
    power_fraction,
)

KINDS = ("cnn", "transformer")
GROUPS = tuple(f"{k}/{c}" for k in KINDS for c in ("16bit", "tf32", "fp32"))
_PRECISION = {"amp": "fp16", "tf32": "tf32", "fp32": "fp32", "bf16": "bf16"}


@dataclass(frozen=True)
class PublishedRow:
    """One published throughput figure."""

    workload: str
    seq_len: int | None
    system: str
    gpu: str
    gpus: int
    precision: str
    batch_per_gpu: int
    samples_per_s: float
    source: str = "unknown"
    fp32_math: str = "default"
    """what the source's stack does with fp32 on Ampere+ ("default": convolutions in TF32; "tf32": all)"""

    @property
    def model_name(self) -> str:
        return f"{self.workload}-{self.seq_len}" if self.seq_len else self.workload

    @property
    def packed(self) -> bool:
        return self.source == "nvidia-dle" and self.workload.startswith("bert") and (self.seq_len or 0) >= 512


def parse_rows(text: str) -> tuple[PublishedRow, ...]:
    """Rows of a published_training.csv text (lines starting with # are comments)."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return tuple(
        PublishedRow(
            workload=r["workload"],
            seq_len=int(r["seq_len"]) if r["seq_len"].strip() else None,
            system=r["system"],
            gpu=r["gpu"],
            gpus=int(r["gpus"]),
            precision=_PRECISION[r["precision"]],
            batch_per_gpu=int(r["batch_per_gpu"]),
            samples_per_s=float(r["samples_per_s"]),
            source=(r.get("source") or "unknown").strip(),
            fp32_math=(r.get("fp32_math") or "").strip() or "default",
        )
        for r in csv.DictReader(io.StringIO("\n".join(lines)))
    )


@lru_cache(maxsize=1)
def published_rows() -> tuple[PublishedRow, ...]:
    """Every row of hetrain/data/published_training.csv."""
    return parse_rows(resources.files("hetrain").joinpath("data/published_training.csv").read_text())


def _optimizer(row: PublishedRow) -> str:
    """The optimizer step a published recipe is priced with, where `recipe_step_seconds` knows no
    better: a fused SGD with momentum for ResNet-50 (small beside its steps), a fused Adam for BERT-large
    (NVIDIA's pretraining recipe runs fused LAMB)."""
    return "sgd-fused" if row.workload == "resnet50" else "adam-fused"


# Lambda's rounds run BERT-large through NVIDIA's SQuAD script (run_squad.py). In fp32 its optimizer
# is BertAdam: a Python loop over the parameter tensors, about 15 eager ops on each (clipping, the two
# moments, the update, weight decay, the step), 136 bytes of memory traffic a parameter where a fused
# Adam moves 28. Under AMP it is apex's FusedAdam with amp O2: the fused step plus the recipe's
# clipping over the fp32 master gradients, their unscale from fp16 and the copy of the master weights
# back to fp16, 52 bytes a parameter.
PER_TENSOR_ADAM_BYTES = 136
PER_TENSOR_ADAM_OPS = 15
AMP_FUSED_ADAM_BYTES = 52
EAGER_OP_SECONDS = 10e-6
"""A small eager op issued from Python: dispatch (4.5 us a CPU op on this project's CI machine)
and the CUDA kernel launch."""
TENSORS_PER_MATRIX = 2.7
"""Parameter tensors per weight matrix, the biases and norms with it: BERT-large has 391 for 145."""


def recipe_step_seconds(row: PublishedRow, profile, spec) -> float:
    """The optimizer step of the row's published recipe, once per step."""
    if not (row.workload.startswith("bert") and row.source.startswith("lambda")):
        return optimizer_seconds(profile, spec, _optimizer(row))
    if row.precision in ("fp16", "bf16"):
        return parameter_pass_seconds(AMP_FUSED_ADAM_BYTES, profile, spec)
    launches = PER_TENSOR_ADAM_OPS * TENSORS_PER_MATRIX * len(profile.matrix_shapes)
    return parameter_pass_seconds(PER_TENSOR_ADAM_BYTES, profile, spec) + launches * EAGER_OP_SECONDS


def _row_model(row: PublishedRow):
    from hetrain.hardware.catalog import get_gpu
    from hetrain.workload.zoo import get_profile

    profile, spec = get_profile(row.model_name), get_gpu(row.gpu)
    return profile, spec, math_precision(spec, row.precision, profile.kind, row.fp32_math)


@dataclass(frozen=True)
class _Terms:
    """Per-row quantities the fit needs, as arrays."""

    group: np.ndarray
    kind: np.ndarray
    flop_s: np.ndarray
    byte_s: np.ndarray
    gddr: np.ndarray
    l2: np.ndarray
    packed: np.ndarray
    fixed: np.ndarray
    batch: np.ndarray
    observed: np.ndarray
    level: np.ndarray  # index of the row's (source, kind) level factor
    power: np.ndarray  # -log(power_fraction)


def _terms(rows: list[PublishedRow]) -> tuple[_Terms, list[tuple[str, str]]]:
    levels: list[tuple[str, str]] = []
    cols: dict[str, list] = {k: [] for k in _Terms.__dataclass_fields__}
    for r in rows:
        profile, spec, p = _row_model(r)
        flop_s, byte_s = per_sample_terms(profile, spec, p)
        key = (r.source, profile.kind)
        if key not in levels:
            levels.append(key)
        cols["group"].append(GROUPS.index(f"{profile.kind}/{PRECISION_CLASS[p]}"))
        cols["kind"].append(KINDS.index(profile.kind))
        cols["flop_s"].append(flop_s)
        cols["byte_s"].append(byte_s)
        cols["gddr"].append(graphics_memory(spec))
        cols["l2"].append(spec.l2_bytes)
        cols["packed"].append(r.packed)
        cols["fixed"].append(fixed_seconds_per_microbatch(profile, spec, p)   # one micro-batch a step
                             + recipe_step_seconds(r, profile, spec))
        cols["batch"].append(r.batch_per_gpu)
        cols["observed"].append(r.samples_per_s / r.gpus)
        cols["level"].append(levels.index(key))
        cols["power"].append(-math.log(power_fraction(spec, p)))
    return _Terms(**{k: np.asarray(v) for k, v in cols.items()}), levels


# Efficiencies the fit leaves free: the others sit at 1 (peak), where free fits put them anyway;
# the memory traffic, the host term and the power limit carry what those parts lose.
FREE_EFFICIENCIES = ("transformer/tf32", "transformer/fp32")
_FREE = [GROUPS.index(g) for g in FREE_EFFICIENCIES]
_SHARED = len(_FREE) + 7


def _unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float, float, float, float]:
    n = len(_FREE)
    eff = np.ones(len(GROUPS))
    eff[_FREE] = 1.0 / (1.0 + np.exp(-x[:n]))
    passes = np.exp(x[n:n + 2])
    gddr_eff = float(np.exp(x[n + 2]))
    fraction = float(1.0 / (1.0 + np.exp(-x[n + 3])))
    l2_scale = float(np.exp(x[n + 4])) * 1e6
    host = float(np.exp(x[n + 5])) * 1e-6  # per image, CNNs only
    power = float(np.exp(x[n + 6]))
    return eff, passes, gddr_eff, fraction, l2_scale, host, power


def _level_logs(x: np.ndarray, levels: list[tuple[str, str]]) -> np.ndarray:
    """Log level per (source, kind); each kind's levels sum to 0 (geometric mean 1)."""
    out = np.zeros(len(levels))
    free = x[_SHARED:]
    i = 0
    for kind in KINDS:
        idx = [j for j, (_, k) in enumerate(levels) if k == kind]
        for j in idx[:-1]:
            out[j] = free[i]
            i += 1
        if idx:
            out[idx[-1]] = -sum(out[j] for j in idx[:-1])
    return out


def _n_free(levels: list[tuple[str, str]]) -> int:
    return sum(max(0, sum(1 for _, k in levels if k == kind) - 1) for kind in KINDS)


def _residuals(x: np.ndarray, t: _Terms, levels: list[tuple[str, str]]) -> np.ndarray:
    eff, passes, gddr_eff, fraction, l2_scale, host, power = _unpack(x)
    scale = np.where(t.packed, fraction, 1.0) * np.exp(_level_logs(x, levels))[t.level]
    bandwidth = np.where(t.gddr, gddr_eff, 1.0) * (1.0 + t.l2 / l2_scale)
    per_sample = (t.flop_s * np.exp(power * t.power) / eff[t.group] + passes[t.kind] * t.byte_s / bandwidth
                  + np.where(t.kind == KINDS.index("cnn"), host, 0.0))
    predicted = t.batch / (t.batch * per_sample * scale + t.fixed)
    return np.log(predicted / t.observed)


def fit(rows: list[PublishedRow] | tuple[PublishedRow, ...]) -> Calibration:
    """Robust least-squares fit (log error) of the constants on the single-GPU rows."""
    from scipy.optimize import least_squares

    rows = [r for r in rows if r.gpus == 1]
    t, levels = _terms(rows)
    x0 = np.concatenate([np.zeros(len(_FREE)), np.log([8.0, 8.0]), [0.0, 1.0, np.log(100.0), np.log(10.0), np.log(0.3)],
                         np.zeros(_n_free(levels))])
    x = least_squares(_residuals, x0, args=(t, levels), loss="soft_l1", f_scale=0.1).x
    eff, passes, gddr_eff, fraction, l2_scale, host, power = _unpack(x)
    l2_seen = len(set(t.l2.tolist())) > 1
    used = set(t.group.tolist())
    kinds = set(t.kind.tolist())
    cnn = KINDS.index("cnn") in kinds
    return Calibration(
        compute_efficiency={g: float(eff[i]) for i, g in enumerate(GROUPS) if i in used or i not in _FREE},
        memory_passes={k: float(passes[i]) for i, k in enumerate(KINDS) if i in kinds},
        graphics_memory_efficiency=gddr_eff if t.gddr.any() else 1.0,
        packed_token_fraction=round(fraction, 3) if t.packed.any() else 1.0,
        l2_scale_bytes=l2_scale if l2_seen else float("inf"),
        power_exponent=power if t.power.any() else 0.0,
        host_seconds_per_sample={"cnn": host} if cnn else {},
        rows=len(rows),
        parameters=len(used & set(_FREE)) + len(kinds) + int(t.gddr.any()) + int(t.packed.any()) + int(l2_seen)
        + int(cnn) + int(t.power.any()) + _n_free(levels),
    )


def fit_scaling(rows: list[PublishedRow] | tuple[PublishedRow, ...], calib: Calibration) -> float:
    """Throughput kept per doubling of GPUs beyond the modelled all-reduce: least squares of
    log((published_n / predicted_n) / (published_1 / predicted_1)) on log2 n, over multi-GPU rows
    whose single-GPU row (same source, workload, GPU, precision) is published; at most 1."""
    plain = replace(calib, scaling_per_doubling=1.0)
    single = {(r.source, r.model_name, r.gpu, r.precision): r for r in rows if r.gpus == 1}
    xy = []
    for r in rows:
        one = single.get((r.source, r.model_name, r.gpu, r.precision))
        if r.gpus > 1 and one is not None:
            kept = (r.samples_per_s / predict_row(r, plain)) / (one.samples_per_s / predict_row(one, plain))
            xy.append((math.log2(r.gpus), math.log(kept)))
    if not xy:
        return 1.0
    return min(1.0, math.exp(sum(x * y for x, y in xy) / sum(x * x for x, _ in xy)))


def fit_all(rows: list[PublishedRow] | tuple[PublishedRow, ...]) -> Calibration:
    """The single-GPU constants (`fit`), then the multi-GPU scaling on top of them."""
    calib = fit(rows)
    return replace(calib, scaling_per_doubling=fit_scaling(rows, calib))


@lru_cache(maxsize=1)
def default_calibration() -> Calibration:
    """Constants fitted on all published rows (single-GPU constants, then multi-GPU scaling)."""
    return fit_all(published_rows())


def predict_row(row: PublishedRow, calib: Calibration) -> float:
    """Predicted samples/s of a published configuration (multi-GPU: one node, ring all-reduce over
    NVLink where the part has it, else PCIe, staged through host memory on parts without peer access,
    as a cluster file's node of them defaults to: `hetrain.hardware.cluster.default_link`)."""
    from hetrain.hardware.catalog import get_gpu
    from hetrain.hardware.cluster import default_link, link_bytes_per_s
    from hetrain.workload.zoo import get_profile

    profile, spec = get_profile(row.model_name), get_gpu(row.gpu)
    if row.packed:  # the recipe's sequences carry fewer tokens than nominal
        profile = profile.model_copy(update={
            "flops_per_sample": profile.flops_per_sample * calib.packed_token_fraction,
            "activation_bytes_per_sample": profile.activation_bytes_per_sample * calib.packed_token_fraction,
        })
    mb = row.batch_per_gpu
    forward_backward = compute_seconds(profile, spec, row.precision, mb, mb, False, calib, row.fp32_math)
    compute = forward_backward + recipe_step_seconds(row, profile, spec)
    exposed = 0.0
    if row.gpus > 1:   # the all-reduce hides under backward, not the optimizer step after it
        kind = default_link([spec])
        link = link_bytes_per_s([spec], kind)
        topo = CommTopology(node_sizes=(row.gpus,), intra_bytes_per_s=link, inter_bytes_per_s=link,
                            host_staged=kind == "host")
        grad_bytes = 4.0 * profile.params
        comm = allreduce_cost(grad_bytes, topo).seconds
        exposed = exposed_seconds(comm, hidden_seconds(topo, forward_backward * backward_fraction(False)), grad_bytes)
    return row.gpus * mb / (compute + exposed) * data_parallel_efficiency(row.gpus, calib)


@dataclass(frozen=True)
class RowResult:
    """A published row, predicted by the fit on every source and by the fit without its source."""

    row: PublishedRow
    predicted: float
    predicted_held_out: float | None

    @property
    def error(self) -> float:
        return self.predicted / self.row.samples_per_s - 1.0

    @property
    def error_held_out(self) -> float | None:
        if self.predicted_held_out is None:
            return None
        return self.predicted_held_out / self.row.samples_per_s - 1.0


@lru_cache(maxsize=None)
def fit_without_source(source: str) -> Calibration:
    """The constants fitted on every published row but `source`'s."""
    return fit_all([r for r in published_rows() if r.source != source])


@lru_cache(maxsize=1)
def evaluate() -> tuple[RowResult, ...]:
    """Every published row: predicted by the full fit, and by a fit that never saw its source."""
    rows = published_rows()
    calib = default_calibration()
    several = len({r.source for r in rows}) > 1
    return tuple(
        RowResult(r, predict_row(r, calib), predict_row(r, fit_without_source(r.source)) if several else None)
        for r in rows
    )


@lru_cache(maxsize=1)
def evaluate_gpu_held_out() -> tuple[tuple[str, tuple[RowResult, ...]], ...]:
    """Per GPU kind: every row, predicted by the full fit and (`predicted_held_out`) by a fit that
    never saw that kind, in any source: what to expect on a GPU kind with no published row."""
    rows = published_rows()
    calib = default_calibration()
    out = []
    for gpu in sorted({r.gpu for r in rows}):
        held = fit_all([r for r in rows if r.gpu != gpu])
        out.append((gpu, tuple(RowResult(r, predict_row(r, calib), predict_row(r, held)) for r in rows)))
    return tuple(out)


def gpu_held_out_errors(multi_gpu: bool | None = None) -> tuple[list[float], list[float]]:
    """(throughput errors of each GPU kind's rows, relative-speed errors of every pair with that
    kind), each predicted by the fit without that kind; `multi_gpu` keeps only multi- (True) or
    single-GPU (False) rows and pairs."""
    def keep(n: int) -> bool:
        return multi_gpu is None or (n > 1) == multi_gpu

    row_errors: list[float] = []
    pair_errors: list[float] = []
    for gpu, results in evaluate_gpu_held_out():
        row_errors += [r.error_held_out for r in results if r.row.gpu == gpu and keep(r.row.gpus)]
        pair_errors += [p.error(True) for p in pairs(results)
                        if gpu in (p.a.row.gpu, p.b.row.gpu) and keep(p.a.row.gpus)]
    return row_errors, pair_errors


@dataclass(frozen=True)
class PairResult:
    """Two GPU kinds of one source in one configuration: published and predicted speed ratio."""

    a: RowResult
    b: RowResult

    @property
    def published(self) -> float:
        return self.a.row.samples_per_s / self.b.row.samples_per_s

    def error(self, held_out: bool = False) -> float:
        pa = self.a.predicted_held_out if held_out else self.a.predicted
        pb = self.b.predicted_held_out if held_out else self.b.predicted
        return (pa / pb) / self.published - 1.0


def pairs(results: tuple[RowResult, ...] | list[RowResult]) -> list[PairResult]:
    """Every pair of different GPU kinds within one source, workload, precision and GPU count."""
    def key(r: RowResult):
        return (r.row.source, r.row.workload, r.row.seq_len or 0, r.row.precision, r.row.gpus)

    out = []
    for _, group in itertools.groupby(sorted(results, key=key), key=key):
        for a, b in itertools.combinations(list(group), 2):
            if a.row.gpu != b.row.gpu:
                out.append(PairResult(a, b))
    return out


def abs_error_stats(errors: list[float]) -> tuple[float, float]:
    """(median, largest) absolute error; NaN for none."""
    if not errors:
        return float("nan"), float("nan")
    return statistics.median(abs(e) for e in errors), max(abs(e) for e in errors)


def summary(results: tuple[RowResult, ...] | list[RowResult]) -> dict[str, float]:
    """Median and largest absolute errors: throughput and relative speed, in-sample and held out."""
    prs = pairs(results)
    held = [r.error_held_out for r in results if r.error_held_out is not None]
    out = {"rows": len(results), "pairs": len(prs)}
    out["median_abs_error"], out["max_abs_error"] = abs_error_stats([r.error for r in results])
    out["held_out_median_abs_error"], out["held_out_max_abs_error"] = abs_error_stats(held)
    out["pair_median_abs_error"], out["pair_max_abs_error"] = abs_error_stats([p.error() for p in prs])
    held_pairs = [p.error(True) for p in prs if p.a.predicted_held_out is not None]
    out["held_out_pair_median_abs_error"], out["held_out_pair_max_abs_error"] = abs_error_stats(held_pairs)
    return out


def summary_gpu_held_out() -> dict[str, float]:
    """Median and largest absolute errors with each GPU kind held out (see gpu_held_out_errors)."""
    row_errors, pair_errors = gpu_held_out_errors()
    out = {"rows": len(row_errors), "pairs": len(pair_errors)}
    out["median_abs_error"], out["max_abs_error"] = abs_error_stats(row_errors)
    out["pair_median_abs_error"], out["pair_max_abs_error"] = abs_error_stats(pair_errors)
    return out
