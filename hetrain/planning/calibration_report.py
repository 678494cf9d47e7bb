"""The validation tables of docs/cost-model.md: every published row and the relative speed of GPU
kinds, predicted by the fit on every source, with each source held out, and with each GPU kind held
out. Regenerate them with `python -m hetrain.planning.calibration_report`."""

from __future__ import annotations

from hetrain.planning.calibration import (
    RowResult,
    abs_error_stats,
    default_calibration,
    evaluate,
    evaluate_gpu_held_out,
    gpu_held_out_errors,
    pairs,
)


def markdown_rows(results: tuple[RowResult, ...] | list[RowResult]) -> str:
    """The docs table: every row, published against predicted (fit on all) and held out."""
    lines = ["| source | workload | seq | gpu | gpus | precision | batch/GPU | published | predicted | error "
             "| held-out prediction | held-out error |", "|" + "---|" * 12]
    for r in results:
        w = r.row
        held = "" if r.predicted_held_out is None else f"{r.predicted_held_out:.0f} | {r.error_held_out:+.1%}"
        lines.append(f"| {w.source} | {w.workload} | {w.seq_len or ''} | {w.gpu} | {w.gpus} | {w.precision} | "
                     f"{w.batch_per_gpu} | {w.samples_per_s:g} | {r.predicted:.0f} | {r.error:+.1%} | {held or ' | '} |")
    return "\n".join(lines)


def markdown_relative_speeds(results: tuple[RowResult, ...] | list[RowResult],
                             references: tuple[str, ...] = ("a100-sxm4-80gb", "a100-sxm4-40gb")) -> str:
    """Single-GPU speed of each GPU kind over the source's A100 SXM in the same workload and
    precision: published, predicted with every source fitted, and by the fit without that source."""
    lines = ["| source | workload | precision | gpu | published vs A100 SXM | predicted | error "
             "| held out | held-out error |", "|" + "---|" * 9]
    single = [r for r in results if r.row.gpus == 1]
    for r in single:
        same = [x for x in single if (x.row.source, x.row.model_name, x.row.precision)
                == (r.row.source, r.row.model_name, r.row.precision)]
        ref = next((x for name in references for x in same if x.row.gpu == name), None)
        if ref is None or r is ref:
            continue
        pub = r.row.samples_per_s / ref.row.samples_per_s
        pred = r.predicted / ref.predicted
        held = "| |"
        if r.predicted_held_out is not None:
            h = r.predicted_held_out / ref.predicted_held_out
            held = f"| {h:.2f} | {h / pub - 1:+.1%} |"
        lines.append(f"| {r.row.source} | {r.row.model_name} | {r.row.precision} | {r.row.gpu} (/ {ref.row.gpu}) | "
                     f"{pub:.2f} | {pred:.2f} | {pred / pub - 1:+.1%} {held}")
    return "\n".join(lines)


def markdown_summary(results: tuple[RowResult, ...] | list[RowResult]) -> str:
    """Median and largest absolute errors, single- and multi-GPU, fitted and held out."""
    lines = ["| rows | count | throughput: fit on all | throughput: source held out | relative speed pairs "
             "| pairs: fit on all | pairs: source held out |", "|" + "---|" * 7]
    for label, keep in (("single-GPU", lambda n: n == 1), ("multi-GPU", lambda n: n > 1), ("all", lambda n: True)):
        rs = [r for r in results if keep(r.row.gpus)]
        ps = [p for p in pairs(results) if keep(p.a.row.gpus)]
        fit_t, held_t = abs_error_stats([r.error for r in rs]), abs_error_stats([r.error_held_out for r in rs if r.error_held_out is not None])
        fit_p, held_p = abs_error_stats([p.error() for p in ps]), abs_error_stats([p.error(True) for p in ps if p.a.predicted_held_out])
        lines.append(f"| {label} | {len(rs)} | {fit_t[0]:.1%} median, {fit_t[1]:.0%} worst | {held_t[0]:.1%} median, "
                     f"{held_t[1]:.0%} worst | {len(ps)} | {fit_p[0]:.1%} median, {fit_p[1]:.0%} worst | "
                     f"{held_p[0]:.1%} median, {held_p[1]:.0%} worst |")
    lines += ["", "| source held out (fit on the others) | rows | throughput | relative speed pairs | pairs |",
              "|---|---|---|---|---|"]
    for source in sorted({r.row.source for r in results}):
        rs = [r for r in results if r.row.source == source and r.error_held_out is not None]
        ps = [p.error(True) for p in pairs(rs)]
        t, pp = abs_error_stats([r.error_held_out for r in rs]), abs_error_stats(ps)
        pair_text = f"{pp[0]:.1%} median, {pp[1]:.0%} worst" if ps else "-"
        lines.append(f"| {source} | {len(rs)} | {t[0]:.1%} median, {t[1]:.0%} worst | {len(ps)} | {pair_text} |")
    lines += ["", "| GPU kind held out (fit on the other kinds, every source) | rows | throughput "
              "| relative speed pairs | pairs |", "|---|---|---|---|---|"]
    for label, multi in (("single-GPU", False), ("multi-GPU", True), ("all", None)):
        row_errors, pair_errors = gpu_held_out_errors(multi)
        t, pp = abs_error_stats(row_errors), abs_error_stats(pair_errors)
        lines.append(f"| {label} | {len(row_errors)} | {t[0]:.1%} median, {t[1]:.0%} worst | {len(pair_errors)} | "
                     f"{pp[0]:.1%} median, {pp[1]:.0%} worst |")
    for gpu, results in evaluate_gpu_held_out():
        rs = [r.error_held_out for r in results if r.row.gpu == gpu]
        ps = [p.error(True) for p in pairs(results) if gpu in (p.a.row.gpu, p.b.row.gpu)]
        t, pp = abs_error_stats(rs), abs_error_stats(ps)
        pair_text = f"{pp[0]:.1%} median, {pp[1]:.0%} worst" if ps else "-"
        lines.append(f"| {gpu} | {len(rs)} | {t[0]:.1%} median, {t[1]:.0%} worst | {len(ps)} | {pair_text} |")
    return "\n".join(lines)


if __name__ == "__main__":
    _results = evaluate()
    print(default_calibration(), "\n")
    print(markdown_summary(_results), "\n")
    print(markdown_relative_speeds(_results), "\n")
    print(markdown_rows(_results), "\n")
    from hetrain.planning.unseen_check import markdown_unseen, unseen_summary

    print(unseen_summary(), "\n")
    print(markdown_unseen())
