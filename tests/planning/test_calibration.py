"""The cost model held against published rows it never saw: each source held out, each GPU kind
held out. The bounds sit just above the figures docs/cost-model.md reports, so a change that makes
the model generalise worse fails here."""

import statistics

import pytest

from hetrain.errors import HetrainError

from hetrain.hardware.catalog import get_gpu
from hetrain.planning.calibration import (
    abs_error_stats,
    default_calibration,
    evaluate,
    fit,
    gpu_held_out_errors,
    pairs,
    published_rows,
    recipe_step_seconds,
    summary,
    summary_gpu_held_out,
)
from hetrain.planning.cost_model import optimizer_seconds, power_fraction, sample_seconds
from hetrain.workload import get_profile


def test_each_source_held_out_stays_within_the_reported_error():
    """Fit on the other sources, predict the source: 9.8% median relative-speed error, 7.8% for
    single GPUs (worst 39%: the V100 in fp32 against the A10 in TF32), 13.3% median throughput
    error (docs/cost-model.md)."""
    s = summary(evaluate())
    assert s["rows"] == len(published_rows()) and s["rows"] >= 200
    assert len({r.source for r in published_rows()}) >= 4
    assert s["held_out_pair_median_abs_error"] <= 0.105
    assert s["held_out_median_abs_error"] <= 0.14
    single = [p.error(True) for p in pairs(evaluate()) if p.a.row.gpus == 1]
    median, worst = abs_error_stats(single)
    assert median <= 0.085 and worst <= 0.40
    assert s["median_abs_error"] <= 0.13 and s["pair_median_abs_error"] <= 0.085


def test_each_gpu_kind_held_out_stays_within_the_reported_error():
    """Fit without a GPU kind (every source), predict its rows and its pairs: 8.3% median
    relative-speed error, 5.8% (worst 29%) for single GPUs, 12.3% median throughput error."""
    s = summary_gpu_held_out()
    assert s["rows"] == len(published_rows())
    assert s["pair_median_abs_error"] <= 0.09 and s["median_abs_error"] <= 0.13
    _, single_pairs = gpu_held_out_errors(multi_gpu=False)
    median, worst = abs_error_stats(single_pairs)
    assert median <= 0.065 and worst <= 0.31


def test_calibration_fits_few_constants_within_physical_bounds():
    c = fit(published_rows())
    sources = len({r.source for r in published_rows()})
    # 9 shared constants, and one level per (source, workload kind) less one per kind (geometric mean 1)
    assert c.parameters <= 9 + 2 * (sources - 1) and c.rows == sum(1 for r in published_rows() if r.gpus == 1)
    assert all(0 < e <= 1.0 + 1e-9 for e in c.compute_efficiency.values())
    assert all(1 <= p <= 40 for p in c.memory_passes.values())
    assert 0.2 < c.power_exponent < 1.5
    assert 0 < c.host_seconds_per_sample["cnn"] < 1e-3  # under a millisecond per image
    assert 0.9 < default_calibration().scaling_per_doubling <= 1.0


def test_power_limited_parts_run_below_their_quoted_peaks():
    """The A10 (150 W) has a higher tensor-core peak than the RTX 3090 (350 W, same die family) but
    trains BERT-large slower, as published; A100 PCIe parts (250 W, 300 W) against the SXM (400 W)."""
    assert power_fraction(get_gpu("a10")) < 0.6
    assert power_fraction(get_gpu("a100-pcie-40gb")) < power_fraction(get_gpu("a100-pcie-80gb")) < 1.0
    assert power_fraction(get_gpu("a100-sxm4-80gb")) == power_fraction(get_gpu("rtx-3090")) == 1.0
    bert = get_profile("bert-large-384")
    a10, rtx3090 = get_gpu("a10"), get_gpu("rtx-3090")
    assert a10.peak_flops["fp16"] > rtx3090.peak_flops["fp16"]
    assert sample_seconds(bert, a10, "fp16") > sample_seconds(bert, rtx3090, "fp16")


def test_the_power_limit_is_measured_against_the_family_reference_not_its_lowest_bin():
    """A lower bin of a die (RTX 3080, 3060 on GA10x; RTX 4080 on Ada) draws more power per peak FLOP
    than the family's reference part: it is not power-limited, and it does not make the reference so."""
    for name in ("rtx-3080", "rtx-3060", "rtx-4080", "rtx-3090", "rtx-4090", "a100-sxm4-80gb", "h100-sxm5-80gb"):
        assert power_fraction(get_gpu(name)) == 1.0, name
    for name in ("a30", "a40", "rtx-a6000", "l40", "l40s", "rtx-6000-ada", "l4"):
        assert power_fraction(get_gpu(name)) < 1.0, name
    assert power_fraction(get_gpu("a10")) == pytest.approx((150 / 31.2) / (350 / 35.6))


def test_turing_parts_are_measured_against_the_rtx_2080_ti():
    """The T4 (70 W) had no family reference before the Turing cards joined the catalog and was priced
    at its full tensor peak; the TITAN RTX and Quadro boards run FP32-accumulate tensor math at twice
    the GeForce rate on about the same power."""
    ti, t4, titan = get_gpu("rtx-2080-ti"), get_gpu("t4"), get_gpu("titan-rtx")
    assert ti.power_reference and power_fraction(ti, "fp16") == 1.0
    assert power_fraction(t4, "fp16") == pytest.approx((70 / 65) / (260 / 56.9))
    assert power_fraction(titan, "fp16") == pytest.approx((280 / 130.5) / (260 / 56.9))
    assert power_fraction(titan, "fp16") < power_fraction(titan, "fp32") < 1.0
    resnet = get_profile("resnet50")
    assert sample_seconds(resnet, t4, "fp16") > sample_seconds(resnet, ti, "fp16") * 1.5


def test_tensor_work_is_power_limited_per_tensor_flop():
    """Professional graphics parts run FP32-accumulate tensor math at full rate, GeForce parts at half:
    on the tensor cores the A10 and the RTX 6000 Ada are further from their peaks than on the fp32
    units; HBM parts, whose tensor and fp32 peaks scale alike, are limited alike in every math."""
    a10, ada = get_gpu("a10"), get_gpu("rtx-6000-ada")
    assert power_fraction(a10, "fp16") == pytest.approx((150 / 125) / (350 / 71))
    assert power_fraction(a10, "tf32") == pytest.approx((150 / 62.5) / (350 / 35.6))
    assert power_fraction(ada, "bf16") == pytest.approx((300 / 364.2) / (450 / 165.2))
    for name in ("a100-pcie-40gb", "h100-pcie-80gb", "v100-pcie-32gb"):
        spec = get_gpu(name)
        assert power_fraction(spec, "fp16") == pytest.approx(power_fraction(spec, "fp32"), rel=0.02), name
    # Published, the RTX 6000 Ada trains BERT-large in AMP at 0.85 of the RTX 4090's speed; taken per
    # fp32 FLOP the model had it 1.17x faster, per tensor FLOP 1.08x.
    bert = get_profile("bert-large-384")
    assert sample_seconds(bert, get_gpu("rtx-4090"), "fp16") / sample_seconds(bert, ada, "fp16") < 1.12


def test_single_gpu_relative_speed_against_a100_sxm_holds_held_out():
    """The ratio a split uses: every single-GPU kind against its source's A100 SXM, source held out
    (6.2% median, 28% worst: the table in docs/cost-model.md)."""
    res = [r for r in evaluate() if r.row.gpus == 1]
    errors = []
    for r in res:
        ref = next((x for x in res if x.row.gpu.startswith("a100-sxm4") and x is not r and
                    (x.row.source, x.row.model_name, x.row.precision) == (r.row.source, r.row.model_name, r.row.precision)),
                   None)
        if ref is not None:
            errors.append((r.predicted_held_out / ref.predicted_held_out) / (r.row.samples_per_s / ref.row.samples_per_s) - 1)
    assert len(errors) >= 40
    assert statistics.median(abs(e) for e in errors) <= 0.07 and max(abs(e) for e in errors) <= 0.30


def test_the_optimizer_step_is_priced_once_per_step_at_memory_bandwidth():
    """A fused Adam reads weights, gradients and two states and writes three back (28 bytes a
    parameter); torch's default AdamW step, multi-tensor, makes a pass per operation (80 bytes). Once
    per step whatever the share; a measured profile has its own optimizer seconds, the model too."""
    from hetrain.hardware.cluster import cluster_from_devices
    from hetrain.planning.cost_model import compute_seconds, optimizer_seconds
    from hetrain.planning.kinds import kinds_of

    bert, a100 = get_profile("bert-large-384"), get_gpu("a100-sxm4-80gb")
    assert optimizer_seconds(bert, a100, "adamw-fused") == pytest.approx(28 * bert.params / 2039e9)
    assert optimizer_seconds(bert, a100, "adamw") == pytest.approx(80 * bert.params / 2039e9)
    assert optimizer_seconds(bert, a100, "sgd-nomomentum") == pytest.approx(12 * bert.params / 2039e9)
    assert optimizer_seconds(bert, a100, None) == 0.0
    with_adam = compute_seconds(bert, a100, "bf16", 64, 16, optimizer="adamw")
    assert with_adam - compute_seconds(bert, a100, "bf16", 64, 16) == pytest.approx(optimizer_seconds(bert, a100, "adamw"))
    (kind,) = kinds_of(cluster_from_devices("a100-sxm4-80gb:2"), bert, "bf16", default_calibration(), optimizer="adamw")
    # a second micro-batch adds its own fixed part, not a second optimizer step
    assert kind.time(32, 16, False) - kind.time(16, 16, False) == pytest.approx(kind.fixed_s + 16 * kind.sample_s)
    assert kind.time(16, 16, False) == pytest.approx(kind.fixed_s + 16 * kind.sample_s + kind.optimizer_s)


def test_published_bert_rows_pay_their_recipes_optimizer_step():
    """Lambda's BERT-large rows run NVIDIA's SQuAD script: in fp32 BertAdam, a Python loop of eager
    ops over every parameter tensor (about 60 ms a step beyond a fused Adam, on any card), under AMP a
    fused step of 52 bytes a parameter; other recipes keep their optimizer's fused step. Priced so,
    the RTX 3080 at 2 sequences a step, a card the fit never saw, is within 25% (it was 112% too
    fast: docs/cost-model.md)."""
    from hetrain.planning.unseen_check import evaluate_unseen
    from hetrain.workload.zoo import get_profile

    bert = get_profile("bert-large-384")
    row = {(r.source, r.gpu, r.precision, r.gpus): r for r in published_rows() if r.workload == "bert-large"}
    for gpu in ("a100-sxm4-80gb", "v100-sxm2-16gb"):
        spec = get_gpu(gpu)
        fused = optimizer_seconds(bert, spec, "adam-fused")
        loop = recipe_step_seconds(row[("lambda-2023", gpu, "fp32", 1)], bert, spec)
        assert 0.05 < loop - fused < 0.12, gpu
        amp = recipe_step_seconds(row[("lambda-2023", gpu, "fp16", 1)], bert, spec)
        assert amp == pytest.approx(fused * 52 / 28)
    dle = next(r for r in published_rows() if r.source == "nvidia-dle" and r.workload == "bert-large")
    a100 = get_gpu(dle.gpu)
    assert recipe_step_seconds(dle, bert, a100) == optimizer_seconds(bert, a100, "adam-fused")
    rtx3080 = next(r for r in evaluate_unseen() if (r.row.gpu, r.row.workload, r.row.precision, r.row.gpus)
                   == ("rtx-3080", "bert-large", "fp32", 1))
    assert rtx3080.row.batch_per_gpu == 2 and abs(rtx3080.error) <= 0.25


def test_every_optimizer_word_is_priced_and_a_fused_step_plans_faster():
    """The CLI's and the planner's optimizer words are the vocabulary's, each with its state and its
    step; `adamw-fused` (fused=True) keeps AdamW's state and plans a shorter step than torch's default."""
    from hetrain.hardware.cluster import cluster_from_devices
    from hetrain.planning.cost_model import OPTIMIZER_STATE_BYTES, OPTIMIZER_STEP_BYTES
    from hetrain.planning.planner import plan_job
    from hetrain.vocabulary import OPTIMIZERS

    assert set(OPTIMIZERS) == set(OPTIMIZER_STATE_BYTES) == set(OPTIMIZER_STEP_BYTES)
    assert OPTIMIZER_STATE_BYTES["adamw-fused"] == OPTIMIZER_STATE_BYTES["adamw"]
    cluster, bert = cluster_from_devices("a100-sxm4-80gb:1,v100-sxm2-16gb:1"), get_profile("bert-large-384")
    plain = plan_job(cluster, bert, 64, optimizer="adamw", strategy="balanced")
    fused = plan_job(cluster, bert, 64, optimizer="adamw-fused", strategy="balanced")
    assert fused.plan.predicted_samples_per_s > plain.plan.predicted_samples_per_s
    with pytest.raises(HetrainError, match="adamw-fused"):
        plan_job(cluster, bert, 64, optimizer="adamw-foreach")
