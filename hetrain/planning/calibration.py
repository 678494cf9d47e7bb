"""Fit the compute model's few constants on the single-GPU rows of published_training.csv, and
predict every row (single- and multi-GPU) against what was published.

Fitted: one efficiency per (workload kind, precision class) - cnn|transformer x 16-bit tensor
core|tf32 tensor core|fp32 - bounded to at most 100% of peak, one count of memory passes over
activation bytes shared by all, and the token fraction of the published BERT-512 recipe (it packs
unpadded sequences). Eight constants on fourteen rows.
The device's own peak FLOP/s and memory bandwidth carry the difference between GPU generations.
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass
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
    exposed_seconds,
    fixed_seconds_per_microbatch,
    per_sample_terms,
)

GROUPS = tuple(f"{k}/{c}" for k in ("cnn", "transformer") for c in ("16bit", "tf32", "fp32"))
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

    @property
    def model_name(self) -> str:
        return f"{self.workload}-{self.seq_len}" if self.seq_len else self.workload

    @property
    def packed(self) -> bool:
        return self.workload.startswith("bert") and (self.seq_len or 0) >= 512


@lru_cache(maxsize=1)
def published_rows() -> tuple[PublishedRow, ...]:
    """Every row of hetrain/data/published_training.csv."""
    text = resources.files("hetrain").joinpath("data/published_training.csv").read_text()
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
        )
        for r in csv.DictReader(io.StringIO("\n".join(lines)))
    )


def _row_terms(row: PublishedRow) -> tuple[np.ndarray, float, float]:
    """Design row (coefficients of 1/efficiency per group and of memory passes), fixed and observed seconds."""
    from hetrain.hardware.catalog import get_gpu
    from hetrain.workload.zoo import get_profile

    profile, spec = get_profile(row.model_name), get_gpu(row.gpu)
    flop_s, byte_s = per_sample_terms(profile, spec, row.precision)
    x = np.zeros(len(GROUPS) + 1)
    x[GROUPS.index(f"{profile.kind}/{PRECISION_CLASS[row.precision]}")] = row.batch_per_gpu * flop_s
    x[-1] = row.batch_per_gpu * byte_s
    fixed = fixed_seconds_per_microbatch(profile, spec, row.precision)
    return x, fixed, row.batch_per_gpu / row.samples_per_s


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-12
    return x


def _solve(a: np.ndarray, b: np.ndarray, used: np.ndarray) -> tuple[float, np.ndarray]:
    lower = np.where(np.arange(a.shape[1]) < len(GROUPS), 1.0, 0.0)  # efficiency <= 100% of peak
    lower[~used] = 0.0
    coef = np.zeros(a.shape[1])
    coef[used] = nnls(a[:, used], b - a @ lower)[0 : used.sum()] + lower[used]
    return float(np.sum((a @ coef - b) ** 2)), coef


def fit(rows: list[PublishedRow] | tuple[PublishedRow, ...]) -> Calibration:
    """Least relative-squared-error fit of the constants on single-GPU rows (efficiency <= 1)."""
    rows = [r for r in rows if r.gpus == 1]
    terms = [_row_terms(r) for r in rows]
    base = np.array([x / t for x, _, t in terms])
    b = np.array([1.0 - f / t for _, f, t in terms])
    packed = np.array([r.packed for r in rows])
    used = base.any(axis=0)

    def at(fraction: float) -> tuple[float, np.ndarray]:
        return _solve(np.where(packed[:, None], base * fraction, base), b, used)

    fraction = 1.0
    if packed.any():  # coarse grid, then refine around the best
        grid = np.arange(0.30, 1.0001, 0.05)
        fraction = float(min(grid, key=lambda f: at(f)[0]))
        grid = np.arange(max(0.30, fraction - 0.05), min(1.0, fraction + 0.05) + 1e-9, 0.01)
        fraction = float(min(grid, key=lambda f: at(f)[0]))
    _, coef = at(fraction)
    eff = {g: float(1.0 / coef[i]) for i, g in enumerate(GROUPS) if used[i]}
    params = int(used[: len(GROUPS)].sum()) + 1 + int(packed.any())
    return Calibration(compute_efficiency=eff, memory_passes=float(coef[-1]),
                       packed_token_fraction=round(fraction, 2), rows=len(rows), parameters=params)


@lru_cache(maxsize=1)
def default_calibration() -> Calibration:
    """Constants fitted on all single-GPU published rows."""
    return fit(published_rows())


def predict_row(row: PublishedRow, calib: Calibration) -> float:
    """Predicted samples/s of a published configuration (multi-GPU: one DGX node, NVLink ring)."""
    from hetrain.hardware.catalog import get_gpu
    from hetrain.workload.zoo import get_profile

    profile, spec = get_profile(row.model_name), get_gpu(row.gpu)
    if row.packed:  # the recipe's sequences carry fewer tokens than nominal
        profile = profile.model_copy(update={
            "flops_per_sample": profile.flops_per_sample * calib.packed_token_fraction,
            "activation_bytes_per_sample": profile.activation_bytes_per_sample * calib.packed_token_fraction,
        })
    mb = row.batch_per_gpu
    compute = compute_seconds(profile, spec, row.precision, mb, mb, False, calib)
    exposed = 0.0
    if row.gpus > 1:
        link = spec.nvlink_bytes_per_s or spec.pcie_bytes_per_s
        topo = CommTopology(node_sizes=(row.gpus,), intra_bytes_per_s=link, inter_bytes_per_s=link)
        grad_bytes = 4.0 * profile.params
        comm = allreduce_cost(grad_bytes, topo).seconds
        exposed = exposed_seconds(comm, compute * backward_fraction(False), grad_bytes)
    return row.gpus * mb / (compute + exposed)


@dataclass(frozen=True)
class RowResult:
    """A published row with the in-sample and leave-one-out predictions."""

    row: PublishedRow
    predicted: float
    predicted_loo: float | None

    @property
    def error(self) -> float:
        return self.predicted / self.row.samples_per_s - 1.0

    @property
    def error_loo(self) -> float | None:
        return None if self.predicted_loo is None else self.predicted_loo / self.row.samples_per_s - 1.0


def evaluate() -> list[RowResult]:
    """Every published row predicted by the full fit and, for single-GPU rows, by a fit without it."""
    rows = published_rows()
    calib = default_calibration()
    single = [r for r in rows if r.gpus == 1]
    out = []
    for r in rows:
        loo = None
        if r.gpus == 1:
            loo = predict_row(r, fit([s for s in single if s is not r]))
        out.append(RowResult(r, predict_row(r, calib), loo))
    return out


def summary(results: list[RowResult]) -> dict[str, float]:
    """Median and largest absolute relative error, over all rows and leave-one-out rows."""
    errs = [abs(r.error) for r in results]
    loo = [abs(r.error_loo) for r in results if r.error_loo is not None]
    return {
        "rows": len(results),
        "median_abs_error": statistics.median(errs),
        "max_abs_error": max(errs),
        "loo_median_abs_error": statistics.median(loo) if loo else float("nan"),
        "loo_max_abs_error": max(loo) if loo else float("nan"),
    }
