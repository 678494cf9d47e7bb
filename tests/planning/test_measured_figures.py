"""Plans from measured figures: device profiles and a run's measured rates replace the model's
figures for the device kinds they cover, and the plan says which figures are which."""

import json
import subprocess
import sys

import pytest

from hetrain.errors import HetrainError
from hetrain.hardware.cluster import cluster_from_devices, get_preset
from hetrain.planning.measured_rates import DeviceRate, MeasuredRates
from hetrain.planning.planner import plan_job
from hetrain.workload import get_profile
from hetrain.workload.device_profile import DeviceProfile, Stamp, StepTiming, load_profiles

A100, V100 = "a100-sxm4-80gb", "v100-sxm2-32gb"


def _stamp() -> Stamp:
    return Stamp(device_name="NVIDIA A100-SXM4-80GB", driver="550.54", torch="2.8.0", cuda="12.4",
                 date="2026-01-01T00:00:00+00:00")


def _profile(device: str, points: list[tuple[int, float]], precision: str = "bf16", model: str = "resnet50"):
    return DeviceProfile(model=model, device=device, stamp=_stamp(), optimizer_seconds=0.002,
                         steps=[StepTiming(precision=precision, micro_batch=b, seconds=t) for b, t in points])


def _share_fraction(result, device: str) -> float:
    ranks = result.plan.ranks
    return sum(r.share for r in ranks if r.device == device) / result.plan.global_batch_size


def test_profile_interpolates_between_measured_micro_batches_and_extends_the_last_line():
    p = _profile(A100, [(8, 0.010), (32, 0.030), (64, 0.050)])
    assert p.microbatch_seconds("bf16", 8) == pytest.approx(0.010)
    assert p.microbatch_seconds("bf16", 16) == pytest.approx(0.010 + 8 * 0.020 / 24)
    assert p.microbatch_seconds("bf16", 48) == pytest.approx(0.040)
    assert p.microbatch_seconds("bf16", 128) == pytest.approx(0.050 + 64 * 0.020 / 32)
    assert 0 < p.microbatch_seconds("bf16", 2) < 0.010
    with pytest.raises(HetrainError, match="no fp32 timings"):
        p.microbatch_seconds("fp32", 8)


def test_a_disturbed_profile_is_never_extrapolated_below_its_largest_timing_and_is_named():
    """Micro-batch 8 timed faster than 4 (other load on the machine): the line through them falls,
    and extended to 32 it gave a micro-batch no time at all; a plan on it predicted 894 samples/s
    where the cost model says 1.5. Beyond the largest size the time now grows in proportion, and the
    profile and the plan say that its timings were disturbed."""
    p = _profile("cpu", [(4, 2.40), (8, 1.31)], precision="fp32")
    assert p.microbatch_seconds("fp32", 32) == pytest.approx(1.31 * 4)
    assert p.microbatch_seconds("fp32", 6) == pytest.approx((2.40 + 1.31) / 2)   # measured range: as timed
    assert "micro-batch 8 faster than micro-batch 4" in p.disturbed_note()
    assert _profile(A100, [(8, 0.010), (32, 0.030)]).disturbed_note() is None
    # flat timings (a latency-bound GPU) are no disturbance: a noise-sized fall extends flat, not 7x
    flat = _profile(A100, [(1, 0.0100), (2, 0.0100), (4, 0.0100), (8, 0.0099)])
    assert flat.disturbed_note() is None and flat.microbatch_seconds("bf16", 64) == pytest.approx(0.0099)
    result = plan_job(cluster_from_devices("cpu:2"), get_profile("resnet50"), 64, profiles={"cpu": p})
    assert result.plan.predicted_samples_per_s <= 64 / (1.31 * 4)   # each rank: 32 samples, 4x the 8-sample time
    assert any("disturbed" in n for n in result.plan.notes), result.plan.notes


def test_plan_uses_a_profile_where_it_exists_and_marks_each_kind():
    cluster = cluster_from_devices("a100:1,v100:1")
    model = get_profile("resnet50")
    plain = plan_job(cluster, model, 512)
    # The measured A100 is 3x slower than the model says: its share must shrink, and say why.
    a100_rank = next(r for r in plain.plan.ranks if r.device == A100)
    t = 3 * a100_rank.predicted_step_seconds / a100_rank.share
    prof = _profile(A100, [(32, 32 * t), (256, 256 * t)])
    measured = plan_job(cluster, model, 512, profiles={A100: prof})
    assert measured.figures == {A100: "measured-profile", V100: "modelled"}
    assert _share_fraction(measured, A100) < _share_fraction(plain, A100) - 0.1
    notes = " ".join(measured.plan.notes)
    assert f"{A100}: measured profile of resnet50" in notes and f"{V100}: modelled" in notes
    rows = {r["device"]: r["figures"] for r in measured.to_dict()["ranks"]}
    assert rows == {A100: "measured-profile", V100: "modelled"}


def test_a_micro_batch_outside_the_profiled_sizes_is_said_to_be_extrapolated():
    cluster = cluster_from_devices("a100:1,v100:1")
    model = get_profile("resnet50")
    narrow = plan_job(cluster, model, 512, profiles={A100: _profile(A100, [(8, 0.01), (32, 0.03)])})
    mb = next(r.micro_batch for r in narrow.plan.ranks if r.device == A100)
    assert mb > 32
    note = next(n for n in narrow.plan.notes if "extrapolated" in n)
    assert note.startswith(f"{A100}: micro-batch {mb} lies outside the sizes its profile timed (8-32)")
    assert f"--micro-batches 8,32,{mb}" in note
    wide = plan_job(cluster, model, 512, profiles={A100: _profile(A100, [(8, 0.01), (1024, 1.0)])})
    assert not any("extrapolated" in n for n in wide.plan.notes)


def test_a_profile_without_the_chosen_precision_falls_back_to_the_model():
    cluster = cluster_from_devices("a100:1,v100:1")
    prof = _profile(A100, [(32, 0.1)], precision="fp32")
    result = plan_job(cluster, get_profile("resnet50"), 256, profiles={A100: prof})
    assert result.figures[A100] == "modelled"
    assert any("has no bf16 timings" in n for n in result.plan.notes)


def _rates(a100_per_sample: float, v100_per_sample: float) -> MeasuredRates:
    return MeasuredRates(step=200, global_batch_size=512, devices=[
        DeviceRate(device=A100, precision="bf16", ranks=1, per_sample_seconds=a100_per_sample,
                   fixed_seconds=0.01, share=256),
        DeviceRate(device=V100, precision="fp16", ranks=1, per_sample_seconds=v100_per_sample,
                   fixed_seconds=0.01, share=256),
    ])


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "hetrain.cli.main", "plan", *args], capture_output=True,
                          text=True, timeout=120)


def test_from_run_moves_the_shares_toward_the_rates_the_run_measured(tmp_path):
    modelled = json.loads(_plan_cli("--devices", "a100:1,v100:1", "--model", "resnet50",
                                    "--global-batch-size", "512", "--json").stdout)
    before = sum(r["share"] for r in modelled["ranks"] if r["device"] == A100) / 512
    # The run measured the A100 only 1.25x as fast per sample as the V100: 5/9 of the batch is its due.
    _rates(0.8e-3, 1.0e-3).save(tmp_path)
    p = _plan_cli("--devices", "a100:1,v100:1", "--model", "resnet50", "--global-batch-size", "512",
                  "--from-run", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    after = sum(r["share"] for r in d["ranks"] if r["device"] == A100) / 512
    implied = (1 / 0.8) / (1 / 0.8 + 1 / 1.0)
    assert before > 0.65  # the model's A100 is much faster than what this run measured
    assert abs(after - implied) < 0.02 < abs(before - implied)
    assert {r["figures"] for r in d["ranks"]} == {"measured-run"}
    assert any("measured in a run (step 200" in n for n in d["notes"])


def test_from_run_replans_the_runs_global_batch_size_by_default(tmp_path):
    _rates(0.8e-3, 1.0e-3).save(tmp_path)
    p = _plan_cli("--devices", "a100:1,v100:1", "--model", "resnet50", "--from-run", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["plan"]["global_batch_size"] == 512
    bare = _plan_cli("--devices", "a100:1,v100:1", "--model", "resnet50")
    assert bare.returncode == 2 and "--global-batch-size is required" in bare.stderr


def test_from_run_without_a_rates_file_is_a_one_line_error(tmp_path):
    p = _plan_cli("--devices", "a100:1,v100:1", "--model", "resnet50", "--global-batch-size", "512",
                  "--from-run", str(tmp_path))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "measured-rates.json does not exist" in p.stderr
    # a pipeline run, whose balancing is off, never writes one: the line says so and names what to plan with
    assert "a pipeline plan, or balancing turned off) measures none" in p.stderr and "--profiles DIR" in p.stderr


def test_cpu_profile_then_plan_with_it(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(
        "import torch\n"
        "def make_model():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n"
        "    return m, lambda n: torch.randn(n, 32)\n")
    out = tmp_path / "profiles"
    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", "--script", f"{script}:make_model",
                        "--device", "cpu", "--micro-batches", "4,16", "--repeats", "3", "--seconds", "0.5",
                        "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # a log (stderr not a terminal) gets one line a point: the README's ResNet-50 profile ran for minutes silent
    assert "hetrain profile: cpu: fp32 at micro-batch 4 (1/4)" in p.stderr, p.stderr
    profiles = load_profiles(out)
    cpu = profiles["cpu"]
    assert [s.micro_batch for s in cpu.steps] == [4, 16] and all(s.seconds > 0 for s in cpu.steps)
    assert cpu.stamp.torch and cpu.stamp.threads == 1 and cpu.stamp.date
    assert {b.name for b in cpu.blocks} == {"0", "1", "2"}
    plan = _plan_cli("--devices", "cpu:2", "--profiles", str(out), "--global-batch-size", "64", "--json")
    assert plan.returncode == 0, plan.stderr
    d = json.loads(plan.stdout)
    assert {r["figures"] for r in d["ranks"]} == {"measured-profile"}
    assert d["ranks"][0]["predicted_step_seconds"] == pytest.approx(
        cpu.microbatch_seconds("fp32", d["ranks"][0]["micro_batch"]) * d["ranks"][0]["grad_accum"]
        + cpu.optimizer_seconds, rel=1e-9)


def test_plan_explains_why_a_faster_looking_candidate_lost():
    result = plan_job(get_preset("a100x4+v100x4"), get_profile("resnet152"), 1024)
    faster = [c for c in result.candidates if c.feasible and c.samples_per_s > result.plan.predicted_samples_per_s]
    assert faster, "the example needs a candidate predicted faster than the chosen one"
    for c in faster:
        note = next(n for n in result.plan.notes if n.startswith(f"not {c.strategy},"))
        assert "only when model state does not fit" in note and f"--strategy {c.strategy}" in note


def test_pipeline_stages_use_measured_block_times():
    from hetrain.workload.device_profile import BlockTiming

    model = get_profile("gpt2-1.5b")
    names = [b.name for b in model.blocks]
    cluster = cluster_from_devices("v100-16gb:4")  # 1.5B parameters fit no 16 GB device alone
    plain = plan_job(cluster, model, 64, strategy="pipeline")
    # A measured profile in which the last layers are 20x slower than the rest moves the stage cuts.
    slow = {n: (20.0 if i > len(names) - 8 else 1.0) for i, n in enumerate(names)}
    prof = DeviceProfile(model=model.name, device="v100-sxm2-16gb", stamp=_stamp(),
                         steps=[StepTiming(precision="fp16", micro_batch=1, seconds=0.01 * sum(slow.values()))],
                         blocks=[BlockTiming(name=n, precision="fp16", micro_batch=1, seconds=0.01 * slow[n])
                                 for n in names])
    measured = plan_job(cluster, model, 64, strategy="pipeline", profiles={"v100-sxm2-16gb": prof})
    assert measured.plan.pipeline is not None and plain.plan.pipeline is not None
    assert measured.plan.pipeline.stages != plain.plan.pipeline.stages
    last_stage = measured.plan.pipeline.stages[-1]
    assert last_stage[1] - last_stage[0] < plain.plan.pipeline.stages[-1][1] - plain.plan.pipeline.stages[-1][0]


def test_a_stages_micro_batch_time_keeps_the_fixed_cost_the_profile_measured():
    """The profile times micro-batch 2 at 0.77 of micro-batch 8 (mostly fixed cost): a stage's micro-batch
    of 1 is not an eighth of its micro-batch of 8 (a planner that thought so cut 32 micro-batches of 1,
    17x slower than its 4 of 8)."""
    from hetrain.planning.kinds import Kind, stage_seconds_of
    from hetrain.workload.device_profile import BlockTiming

    prof = DeviceProfile(model="tiny", device="cpu", stamp=_stamp(),
                         steps=[StepTiming(precision="fp32", micro_batch=b, seconds=t) for b, t in [(2, 0.77), (8, 1.0)]],
                         blocks=[BlockTiming(name=str(i), precision="fp32", micro_batch=8, seconds=t)
                                 for i, t in enumerate([0.1, 0.3, 0.6])])
    kind = Kind(spec=None, ranks=[0], precision="fp32", note=None, sample_s=0.0, sample_s_ckpt=0.0, fixed_s=0.0,
                measured=prof)
    whole_at_1 = prof.microbatch_seconds("fp32", 1)
    assert whole_at_1 == pytest.approx(0.77 - 0.23 / 6)
    assert stage_seconds_of(kind, 3, 0, 2, 1, False) == pytest.approx(0.4 * whole_at_1)   # not 0.4 / 8
    assert stage_seconds_of(kind, 3, 2, 3, 8, False) == pytest.approx(0.6)
    assert stage_seconds_of(kind, 4, 0, 2, 1, False) is None   # blocks that do not line up: modelled


def test_measured_peak_memory_sets_the_micro_batch_and_the_predicted_memory():
    """A CUDA profile's peaks replace the modelled activations: here they say each sample holds 2 GB
    (far more than the model's figure), so the A100's micro-batch drops to what 2 GB a sample allows,
    and the plan's memory is the modelled states plus the measured activations."""
    from hetrain.planning import cost_model as cm

    cluster = cluster_from_devices("a100:1,v100:1")
    model = get_profile("resnet50")
    plain = plan_job(cluster, model, 512, strategy="balanced")
    weights, grads, _ = cm.state_bytes(model.params, "bf16", "sgd-nomomentum")
    per_sample = 2e9
    timed = [(b, 0.001 * b) for b in (8, 32)]
    prof = DeviceProfile(model="resnet50", device=A100, stamp=_stamp(), optimizer_seconds=0.002, steps=[
        StepTiming(precision="bf16", micro_batch=b, seconds=t, peak_memory_bytes=int(weights + grads + per_sample * b))
        for b, t in timed])
    measured = plan_job(cluster, model, 512, strategy="balanced", profiles={A100: prof})
    before = next(r for r in plain.plan.ranks if r.device == A100)
    after = next(r for r in measured.plan.ranks if r.device == A100)
    assert after.micro_batch < before.micro_batch
    expected = cm.memory_estimate(model, "bf16", after.micro_batch, optimizer="adamw", zero=0, world=2,
                                  checkpointing=after.activation_checkpointing,
                                  activations=per_sample * after.micro_batch * (
                                      cm.activation_bytes_per_sample(model, "bf16", True)
                                      / cm.activation_bytes_per_sample(model, "bf16", False)
                                      if after.activation_checkpointing else 1.0)).total
    assert after.memory_bytes == pytest.approx(expected, rel=1e-6)
    assert after.memory_bytes <= after.memory_capacity_bytes
    assert not after.activation_checkpointing
    # the largest micro-batch the measured activations allow, and as few micro-batches as it permits
    fit = max(mb for mb in range(1, 200) if cm.memory_estimate(
        model, "bf16", mb, optimizer="adamw", zero=0, world=2, activations=per_sample * mb).total
        <= after.memory_capacity_bytes)
    assert after.micro_batch <= fit and after.grad_accum == -(-after.share // fit)
    notes = " ".join(measured.plan.notes)
    assert f"{A100}: activation memory measured (peaks at micro-batches 8,32)" in notes
    # a profile without peaks (measured on a CPU) leaves memory to the model, and says so
    cpu_like = _profile(A100, timed)
    modelled = plan_job(cluster, model, 512, strategy="balanced", profiles={A100: cpu_like})
    rank = next(r for r in modelled.plan.ranks if r.device == A100)
    assert rank.memory_bytes == cm.memory_estimate(model, "bf16", rank.micro_batch, optimizer="adamw", zero=0,
                                                   world=2, checkpointing=rank.activation_checkpointing).total
    assert any(f"{A100}: memory modelled" in n for n in modelled.plan.notes)


def _run_with_rates(rank, world, root):
    """A balanced 2-rank run (rank 1 at emulated half speed) that checkpoints into `root`."""
    import torch
    import torch.nn.functional as F

    import hetrain
    from tests.memory.models import make_data, make_model

    session = hetrain.Session(balance=True, balance_interval=2, checkpoint_dir=root, checkpoint_interval=1000)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(96), global_batch_size=16)
    while session.step_count < 12:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count >= 12:
                break
    session.close()
    return session.step_count


def test_a_run_leaves_its_measured_rates_for_from_run(tmp_path):
    """The rates a balanced run measured are in its run directory when it ends (written at the first
    re-split, then at most every 30 s, at checkpoints and at close)."""
    from hetrain.planning.measured_rates import MeasuredRates
    from tests.distributed import run_ranks

    run_ranks(_run_with_rates, 2, str(tmp_path), env={"HETRAIN_EMULATE_SPEEDS": "1,0.5"})
    rates = MeasuredRates.load(tmp_path)
    assert rates.step >= 10 and rates.global_batch_size == 16   # the last re-split's figures, not the first's
    assert rates.devices and all(d.per_sample_seconds > 0 for d in rates.devices)
    from tests.memory.models import make_model

    assert rates.model_params == sum(p.numel() for p in make_model().parameters())   # what --from-run checks


def test_from_run_of_another_model_is_refused_naming_both(tmp_path):
    """A digits MLP's run re-planned ResNet-50 at 17,722 samples/s, labelled measured."""
    rates = _rates(0.8e-3, 1.0e-3)
    rates.model_params = 101_770
    rates.save(tmp_path)
    p = _plan_cli("--devices", "a100:1,v100:1", "--model", "resnet50", "--from-run", str(tmp_path))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "measured a model of 101,770 parameters" in p.stderr and "resnet50" in p.stderr, p.stderr
    # every flag it names is one of hetrain plan's or hetrain profile's (it named a --hf-config plan lacks)
    import re

    plan_help = _plan_cli("--help").stdout
    helps = plan_help + subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", "--help"],
                                       capture_output=True, text=True, timeout=60).stdout
    named = set(re.findall(r"--[a-z][a-z-]+", p.stderr))
    assert named and all(flag in helps for flag in named), named
    assert "--hf-config" not in plan_help and "hetrain profile --script" in p.stderr
    rates.model_params = get_profile("resnet50").params
    rates.devices[1].device = "t4"   # a kind the plan does not have: said, not dropped silently
    rates.save(tmp_path)
    p = _plan_cli("--devices", "a100:1,v100:1", "--model", "resnet50", "--from-run", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    assert any("t4: measured in the run, but not among this plan's devices" in n for n in json.loads(p.stdout)["notes"])


def test_a_profiles_adamw_step_is_scaled_to_the_optimizer_the_plan_prices():
    """A profile times torch's default AdamW step; a plan for SGD or a fused AdamW takes the same time
    per byte moved, and says so, while a plan for AdamW keeps the measured step as it is."""
    from hetrain.planning import cost_model as cm
    from hetrain.planning.kinds import kinds_of

    cluster, model = cluster_from_devices("a100:1,v100:1"), get_profile("resnet50")
    prof = _profile(A100, [(32, 0.02), (256, 0.15)])
    calib = cm.default_calibration()

    def a100(optimizer):
        return next(k for k in kinds_of(cluster, model, "auto", calib, {A100: prof}, None, optimizer)
                    if k.spec.name == A100)

    assert a100("adamw").optimizer_s == prof.optimizer_seconds
    assert a100("sgd").optimizer_s == pytest.approx(prof.optimizer_seconds * 32 / 80)
    assert a100("adamw-fused").optimizer_s == pytest.approx(prof.optimizer_seconds * 28 / 80)
    assert a100("sgd").time(256, 256, False) == pytest.approx(0.15 + prof.optimizer_seconds * 32 / 80)
    notes = " ".join(plan_job(cluster, model, 512, profiles={A100: prof}, optimizer="sgd").plan.notes)
    assert "the profile timed an AdamW step (2.0 ms)" in notes and "0.8 ms" in notes
    assert "timed an AdamW step" not in " ".join(plan_job(cluster, model, 512, profiles={A100: prof}).plan.notes)


def test_a_cpu_profile_timed_otherwise_than_the_plan_runs_says_how_to_profile_for_it(monkeypatch):
    """hetrain launch gives each of 2 CPU ranks half the cores: a profile timed as one copy with
    every core predicts a faster step than they run, and the plan's notes say how to profile."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cluster, model = cluster_from_devices("cpu:2"), get_profile("resnet50")

    def notes(threads: int, copies: int) -> list[str]:
        stamp = Stamp(device_name="cpu", torch="2.13.0", threads=threads, concurrent_copies=copies,
                      date="2026-01-01T00:00:00+00:00")
        prof = DeviceProfile(model="resnet50", device="cpu", stamp=stamp, optimizer_seconds=0.01,
                             steps=[StepTiming(precision="fp32", micro_batch=b, seconds=0.05 * b) for b in (4, 16)])
        result = plan_job(cluster, model, 64, profiles={"cpu": prof})
        assert result.figures == {"cpu": "measured-profile"}
        return [n for n in result.plan.notes if "the profile timed" in n]

    [note] = notes(threads=2, copies=1)
    assert "1 copy at once, 2 thread(s) each" in note and "2 rank(s) on a node, 1 thread(s) each" in note
    assert "hetrain profile --device cpu --concurrent 2 --threads 1" in note
    assert notes(threads=1, copies=2) == []


def test_a_profile_of_another_model_is_refused_with_the_fix():
    cluster = cluster_from_devices("a100:1,v100:1")
    with pytest.raises(HetrainError, match=r"a100-sxm4-80gb profile measured 'resnet50', and the plan is for "
                                           r"'gpt2-124m': plan 'resnet50' with it .*or profile 'gpt2-124m' into a fresh "
                                           r"directory"):
        plan_job(cluster, get_profile("gpt2-124m"), 64, profiles={A100: _profile(A100, [(8, 0.01), (32, 0.03)])})


def test_profiles_dir_without_its_workload_names_hetrain_profile(tmp_path):
    p = _plan_cli("--devices", "a100:2", "--profiles", str(tmp_path), "--global-batch-size", "64")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "no workload.json there; profile into it with hetrain profile --model NAME --out DIR" in p.stderr


def test_a_modelled_kind_beside_a_measured_one_leaves_out_the_input_pipeline_term():
    """The published rows' per-image input pipeline (199 us, CNNs) stayed on a modelled A100 beside a
    CPU profile timed on inputs in memory: a small CNN's split gave the CPU 659 of 1024 samples."""
    from hetrain.planning import cost_model as cm
    from hetrain.planning.kinds import kinds_of

    profile = get_profile("resnet50")
    host = cm.default_calibration().host_seconds_per_sample["cnn"]
    alone = kinds_of(cluster_from_devices("a100:1,v100:1"), profile, "auto", cm.default_calibration())
    beside = kinds_of(cluster_from_devices("a100:1,v100:1"), profile, "auto", cm.default_calibration(),
                      profiles={A100: _profile(A100, [(8, 0.010), (32, 0.030)])})
    v100_alone, v100_beside = alone[1], beside[1]
    assert beside[0].source == "measured-profile" and v100_beside.source == "modelled"
    assert v100_beside.sample_s == pytest.approx(v100_alone.sample_s - host)
    assert v100_beside.sample_s_ckpt == pytest.approx(v100_alone.sample_s_ckpt - host)
    assert "without the 199 us per sample of the published rows' input pipeline" in v100_beside.note
    assert alone[0].sample_s > host   # all modelled: the term stays
    # a run's rates count its data waits, as the published rows do: the modelled kind beside them keeps it
    run = kinds_of(cluster_from_devices("a100:1,v100:1"), profile, "auto", cm.default_calibration(),
                   rates=_rates(0.8e-3, 1.0e-3).model_copy(update={"devices": _rates(0.8e-3, 1.0e-3).devices[:1]}))
    assert run[0].source == "measured-run" and run[1].sample_s == pytest.approx(v100_alone.sample_s)
