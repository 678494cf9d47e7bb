"""Published rows of catalog cards the cost model never fits on: the check stays honest (no such card
in the fit) and its figures stay where docs/cost-model.md reports them."""

import statistics

from hetrain.hardware.catalog import get_gpu
from hetrain.planning.calibration import published_rows
from hetrain.planning.unseen_check import evaluate_unseen, markdown_unseen, unseen_pairs, unseen_rows, unseen_summary


def test_no_card_of_the_check_is_in_the_fit():
    unseen, fitted = {r.gpu for r in unseen_rows()}, {r.gpu for r in published_rows()}
    assert unseen == {"rtx-3080", "rtx-a6000", "rtx-6000-ada", "h200-sxm-141gb", "a40", "rtx-2080-ti",
                      "titan-rtx", "quadro-rtx-8000", "quadro-rtx-6000", "quadro-rtx-5000", "b200", "gh200-96gb"}
    assert unseen.isdisjoint(fitted)
    assert all(get_gpu(g).name == g for g in unseen)


def test_every_unseen_row_is_predicted_and_paired_within_its_source():
    results = evaluate_unseen()
    assert len(results) == len(unseen_rows()) == 130
    assert all(r.predicted > 0 and r.predicted_held_out > 0 for r in results)
    for p in unseen_pairs():
        a, b = p.a.row, p.b.row
        assert (a.source, a.workload, a.precision, a.gpus) == (b.source, b.workload, b.precision, b.gpus)
        assert a.gpu != b.gpu


def test_the_check_stays_where_the_docs_report_it():
    """docs/cost-model.md, "Cards the fit never saw": throughput 15.5% median, 80% worst, relative
    speed 9.9% (fit on every source; 9.6% with the source held out), 87% worst; the RTX A6000's
    throughput 5.7% (BERT-large) and 11.1% (ResNet-50); the H200's 7.3% and 9.8%; Turing in fp32
    ResNet-50 within 7%, in AMP 20-40% too fast; the B200 in fp32 ResNet-50 within 9%, in BERT-large
    AMP 58-61% too fast."""
    s = unseen_summary()
    assert s["throughput"][0] <= 0.16 and s["pairs"][0] <= 0.105 and s["pairs_source_held_out"][0] <= 0.10
    # host-staged GeForce all-reduce: the RTX 3080's 2-GPU BERT-large rows were 362% too fast without
    # it; the recipe's optimizer step: its 1-GPU fp32 row was 112% too fast without that
    assert s["throughput"][1] <= 0.85 and s["pairs"][1] <= 0.9
    a6000 = [r.error for r in evaluate_unseen() if r.row.gpu == "rtx-a6000"]
    assert statistics.median(abs(e) for e in a6000) <= 0.10   # 9.4% over its 22 rows
    h200 = [abs(r.error) for r in evaluate_unseen() if r.row.gpu == "h200-sxm-141gb"]
    assert len(h200) == 8 and max(h200) <= 0.17
    text = markdown_unseen()
    assert text.count("\n| lambda-") == 130 and "rtx-6000-ada" in text
    turing = [r for r in evaluate_unseen() if r.row.gpu in {"rtx-2080-ti", "titan-rtx", "quadro-rtx-8000",
                                                             "quadro-rtx-6000", "quadro-rtx-5000"}]
    fp32 = [r.error for r in turing if r.row.workload == "resnet50" and r.row.precision == "fp32"]
    amp = [r.error for r in turing if r.row.workload == "resnet50" and r.row.precision == "fp16"]
    assert len(fp32) == len(amp) == 11 and max(abs(e) for e in fp32) <= 0.08
    assert 0.15 <= min(amp) and max(amp) <= 0.41   # the known weakness, documented
    b200 = {(r.row.workload, r.row.precision, r.row.gpus): r.error for r in evaluate_unseen() if r.row.gpu == "b200"}
    assert len(b200) == 15 and max(abs(b200[("resnet50", "fp32", n)]) for n in (1, 2, 4, 8)) <= 0.10
    assert all(0.45 <= b200[("bert-large", "fp16", n)] <= 0.65 for n in (1, 2, 4))
