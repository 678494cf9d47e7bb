"""Published rows of catalog cards the cost model is never fitted on (hetrain/data/published_unseen.csv):
what the planner predicts for a GPU kind from its datasheet alone, against what was measured.

Each row is predicted by the model as shipped (fitted on every row of published_training.csv) and by
the fit without the row's source (the source's own rows then unseen too). A relative-speed pair sets
an unseen card (first) against another card of the same source, workload, precision and GPU count,
both predicted by the same fit.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from hetrain.planning.calibration import (
    PairResult,
    PublishedRow,
    RowResult,
    abs_error_stats,
    default_calibration,
    evaluate,
    fit_without_source,
    pairs,
    parse_rows,
    predict_row,
)
from hetrain.planning.calibration_report import markdown_rows


@lru_cache(maxsize=1)
def unseen_rows() -> tuple[PublishedRow, ...]:
    """Every row of hetrain/data/published_unseen.csv."""
    return parse_rows(resources.files("hetrain").joinpath("data/published_unseen.csv").read_text())


@lru_cache(maxsize=1)
def evaluate_unseen() -> tuple[RowResult, ...]:
    """Each unseen row, predicted by the full fit and by the fit without its source."""
    calib = default_calibration()
    return tuple(RowResult(r, predict_row(r, calib), predict_row(r, fit_without_source(r.source)))
                 for r in unseen_rows())


def unseen_pairs() -> list[PairResult]:
    """Relative-speed pairs with at least one unseen card, the unseen card first (its speed over the
    other's), in file order: the same pairs, the same way round, on every run."""
    unseen = evaluate_unseen()
    ids = {id(r) for r in unseen}
    out = []
    for p in pairs(list(unseen) + list(evaluate())):
        if id(p.a) in ids or id(p.b) in ids:
            out.append(p if id(p.a) in ids else PairResult(p.b, p.a))
    return out


def unseen_summary() -> dict[str, tuple[float, float]]:
    """(median, largest) absolute error: throughput and relative speed, full fit and source held out."""
    rows, prs = evaluate_unseen(), unseen_pairs()
    return {
        "throughput": abs_error_stats([r.error for r in rows]),
        "throughput_source_held_out": abs_error_stats([r.error_held_out for r in rows]),
        "pairs": abs_error_stats([p.error() for p in prs]),
        "pairs_source_held_out": abs_error_stats([p.error(True) for p in prs]),
    }


def markdown_unseen() -> str:
    """The docs tables: per GPU kind and workload, then every unseen row."""
    rows, prs = evaluate_unseen(), unseen_pairs()
    lines = ["| gpu | workload | rows | throughput: fit on all | source held out | relative speed pairs "
             "| pairs: fit on all | pairs: source held out |", "|" + "---|" * 8]
    for gpu in sorted({r.row.gpu for r in rows}):
        for workload in sorted({r.row.workload for r in rows if r.row.gpu == gpu}):
            rs = [r for r in rows if (r.row.gpu, r.row.workload) == (gpu, workload)]
            ps = [p for p in prs if p.a.row.workload == workload and gpu in (p.a.row.gpu, p.b.row.gpu)]
            t, th = abs_error_stats([r.error for r in rs]), abs_error_stats([r.error_held_out for r in rs])
            q, qh = abs_error_stats([p.error() for p in ps]), abs_error_stats([p.error(True) for p in ps])
            lines.append(f"| {gpu} | {workload} | {len(rs)} | {t[0]:.1%} median, {t[1]:.0%} worst | {th[0]:.1%} "
                         f"median, {th[1]:.0%} worst | {len(ps)} | {q[0]:.1%} median, {q[1]:.0%} worst | "
                         f"{qh[0]:.1%} median, {qh[1]:.0%} worst |")
    return "\n".join(lines) + "\n\n" + markdown_rows(rows)
