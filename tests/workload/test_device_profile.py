"""Measured device profiles: runnable reference modules, timing on the CPU, the profile file."""


import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.workload import get_profile
from hetrain.workload.device_profile import DeviceProfile, load_profiles
from hetrain.workload.measure import measure, measure_cpu_copies
from hetrain.workload.modules import RunnableModel, hf_module, script_module, zoo_module


@pytest.mark.parametrize("name,tolerance", [("resnet50", 0.001), ("gpt2-124m", 0.01), ("bert-large", 0.02)])
def test_zoo_modules_have_the_published_parameter_counts(name, tolerance):
    # BERT's token-type embeddings and pooler are not built: within 2% of the published count.
    module = zoo_module(name).module
    params = sum(p.numel() for p in module.parameters())
    assert params == pytest.approx(get_profile(name).params, rel=tolerance)


def test_zoo_modules_run_forward_on_their_inputs():
    net = zoo_module("resnet50")
    assert net.module(net.make_input(1)).shape == (1, 1000)


def _tiny() -> RunnableModel:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return RunnableModel("tiny", m, lambda n: torch.randn(n, 16))


def test_measure_on_cpu_times_every_micro_batch_and_block():
    prof = measure(_tiny(), torch.device("cpu"), ["fp32"], [2, 8], repeats=3, budget_s=0.2)
    assert [(s.precision, s.micro_batch) for s in prof.steps] == [("fp32", 2), ("fp32", 8)]
    assert all(s.seconds > 0 and s.cpu_seconds is not None and s.peak_memory_bytes is None for s in prof.steps)
    assert [b.name for b in prof.blocks] == ["0", "1", "2"] and prof.optimizer_seconds > 0
    assert prof.device == "cpu" and prof.stamp.torch == torch.__version__ and prof.stamp.cuda is None


def test_measure_reports_its_progress_point_by_point():
    seen = []
    measure(_tiny(), torch.device("cpu"), ["fp32"], [2, 8], repeats=2, budget_s=0.1,
            progress=lambda done, total, what: seen.append((done, total, what)))
    assert [(d, t) for d, t, _ in seen] == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert [w for _, _, w in seen] == ["cpu: fp32 at micro-batch 2", "cpu: fp32 at micro-batch 8", "cpu: an AdamW step",
                                       "cpu: each block's forward and backward", "cpu: done"]


def test_copies_at_once_give_one_profile(tmp_path):
    prof = measure_cpu_copies(_tiny(), 2, 1, ["fp32"], [4], repeats=3, budget_s=0.2)
    assert prof.stamp.concurrent_copies == 2 and len(prof.steps) == 1
    prof.save(tmp_path)
    assert load_profiles(tmp_path)["cpu"] == prof


def test_copies_at_once_time_every_block_unless_told_not_to():
    prof = measure_cpu_copies(_tiny(), 2, 1, ["fp32"], [4], repeats=3, budget_s=0.2)
    assert [b.name for b in prof.blocks] == ["0", "1", "2"] and all(b.seconds >= 0 for b in prof.blocks)
    assert measure_cpu_copies(_tiny(), 2, 1, ["fp32"], [4], repeats=3, budget_s=0.2, blocks=False).blocks == []


def test_copies_at_once_take_each_blocks_median_over_the_copies():
    from hetrain.workload.device_profile import BlockTiming
    from hetrain.workload.measure import _median_profile

    base = measure(_tiny(), torch.device("cpu"), ["fp32"], [2], repeats=2, budget_s=0.1)
    copies = [base.model_copy(update={"blocks": [BlockTiming(name="0", precision="fp32", micro_batch=2, seconds=s)]})
              for s in (1.0, 9.0, 2.0)]
    merged = _median_profile(copies)
    assert [(b.name, b.seconds) for b in merged.blocks] == [("0", 2.0)] and merged.stamp.concurrent_copies == 3


def test_a_copy_that_dies_is_one_line_not_a_wait():
    import os

    def make_input(n):
        os._exit(9)  # as a copy killed for memory

    dying = RunnableModel("dying", torch.nn.Linear(4, 2), make_input)
    with pytest.raises(HetrainError, match=r"exit code 9\) before reporting its timings.*fewer --concurrent"):
        measure_cpu_copies(dying, 2, 1, ["fp32"], [4], repeats=2, budget_s=0.1)


def test_script_factory_errors_name_the_fix(tmp_path):
    with pytest.raises(HetrainError, match="does not exist"):
        script_module(str(tmp_path / "missing.py") + ":make")
    bad = tmp_path / "bad.py"
    bad.write_text("def make():\n    return 3\n")
    with pytest.raises(HetrainError, match=r"must return \(model, make_input\)"):
        script_module(f"{bad}:make")
    with pytest.raises(HetrainError, match="defines no function 'other'"):
        script_module(f"{bad}:other")


def test_hf_config_from_a_config_json_builds_a_runnable_model(tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2).save_pretrained(tmp_path)
    runnable = hf_module(str(tmp_path / "config.json"))
    batch = runnable.make_input(3)
    assert tuple(batch.shape) == (3, 16) and int(batch.max()) < 64
    out = runnable.module(batch)
    assert out.shape == (3, 16, 64)   # logits: the model as a pipeline script builds it (gpt2_blocks)


def test_unreadable_profiles_are_one_line_errors(tmp_path):
    (tmp_path / "a100.json").write_text("{not json")
    with pytest.raises(HetrainError, match="not a readable device profile"):
        load_profiles(tmp_path)
    with pytest.raises(HetrainError, match="is not a directory"):
        load_profiles(tmp_path / "nope")
    (tmp_path / "a100.json").unlink()
    with pytest.raises(HetrainError, match="holds no device profiles"):
        load_profiles(tmp_path)
    with pytest.raises(HetrainError):
        DeviceProfile.load(tmp_path / "missing.json")


def _saved_profile(directory, **changes) -> dict:
    """A small measured CPU profile saved in `directory`, as the dict its file holds (with `changes` made)."""
    import json

    prof = measure(_tiny(), torch.device("cpu"), ["fp32"], [2], repeats=2, budget_s=0.05, blocks=False)
    doc = {**json.loads(prof.model_dump_json()), **changes}
    (directory / f"{doc['device']}.json").write_text(json.dumps(doc))
    return doc


def test_two_profiles_of_one_device_kind_are_refused_naming_both(tmp_path):
    """An older profile kept as cpu-2024.json beside cpu.json: the one whose name sorts last was used silently."""
    import json

    doc = _saved_profile(tmp_path)
    (tmp_path / "cpu-2024.json").write_text(json.dumps({**doc, "stamp": {**doc["stamp"], "date": "2024-01-01"}}))
    with pytest.raises(HetrainError, match=rf"{tmp_path / 'cpu-2024.json'} and {tmp_path / 'cpu.json'} are both "
                                           rf"profiles of cpu \(measured 2024-01-01 and .*\); fix: keep one of them"):
        load_profiles(tmp_path)


def test_a_profile_names_its_device_kind_as_the_catalog_does(tmp_path):
    """A profile written for "A100" or "a100" was keyed by that spelling, which no cluster device matched: the
    planner modelled the device and said nothing of the profile."""
    for spelling in ("a100", "A100-SXM4-80GB", "CPU"):
        for old in tmp_path.glob("*.json"):
            old.unlink()
        _saved_profile(tmp_path, device=spelling)
        assert list(load_profiles(tmp_path)) == ["cpu" if spelling == "CPU" else "a100-sxm4-80gb"]


def test_profiles_of_another_version_and_broken_ones_are_refused_naming_what_they_are(tmp_path):
    """A version 99 profile was planned from as if current; a plan saved into the profiles directory was told
    'model: Field required; device: Field required; ...' (its "notes" read as a misspelling of "steps"): it
    is left out now, with a line saying so."""
    import json

    from hetrain.workload import get_profile

    _saved_profile(tmp_path, version=99)
    with pytest.raises(HetrainError, match="device profile version 99 is not supported; this hetrain reads version 1: "
                                           "re-run hetrain profile"):
        load_profiles(tmp_path)
    (tmp_path / "cpu.json").write_text(json.dumps({"version": 1, "global_batch_size": 8, "notes": [],
                                                   "ranks": [{"rank": 0, "share": 8}]}))
    skipped: list[str] = []
    with pytest.raises(HetrainError, match="holds no device profiles"):   # a plan is left out: none is left
        load_profiles(tmp_path, skipped)
    assert skipped == [f"{tmp_path / 'cpu.json'} is a plan (it has no device, stamp, steps): left out of the profiles"]
    (tmp_path / "cpu.json").write_text(json.dumps({"modle": "tiny", "device": "cpu"}))   # "model" spelt wrong
    with pytest.raises(HetrainError, match=r"not a device profile: hetrain profile writes them \(it lacks stamp, "
                                           r"steps\)$"):
        load_profiles(tmp_path)
    workload = {**json.loads(get_profile("resnet50").model_dump_json()), "version": 99}
    from hetrain.workload.profile import WorkloadProfile

    (tmp_path / "workload.json").write_text(json.dumps(workload))
    with pytest.raises(HetrainError, match="workload profile version 99 is not supported"):
        WorkloadProfile.load(tmp_path / "workload.json")


def test_profile_out_that_is_a_file_is_refused_before_any_timing(tmp_path):
    import subprocess
    import sys

    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", "--model", "resnet50", "--device", "cpu",
                        "--out", str(taken)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"hetrain profile: error: --out '{taken}' is a file, not a directory; fix: give a directory path"], p.stderr


@pytest.mark.parametrize("args,message", [
    (["--model", "resnet50", "--device", "cpu", "--precision", "bf16"], "the CPU profiles in fp32 only"),
    (["--model", "resnet50", "--micro-batches", "0,2"], "write positive integers"),
    (["--model", "nosuchnet"], "unknown model 'nosuchnet'"),
    (["--model", "nosuchnet"], "or time your own model: --script FILE.py:FACTORY or --hf-config"),
])
def test_profile_cli_errors_are_one_line(tmp_path, args, message):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", *args, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("hetrain profile: error:") and message in p.stderr, p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_profile_cli_without_cuda_says_so(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", "--model", "resnet50", "--device", "cuda",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "torch sees no CUDA device here" in p.stderr


def test_cpu_micro_batches_that_would_exhaust_host_memory_are_left_out_with_a_note():
    """GPT-2 small at 1024 tokens keeps about 2.2 GB per sample in fp32: on a 22 GB host, micro-batch 8
    would have the kernel kill the profile; it is left out and the note says why."""
    from hetrain.workload.measure import host_micro_batches

    gb = 1e9
    fit = host_micro_batches([1, 2, 4, 8], 2.2 * gb, 124_000_000, available=22 * gb)
    assert fit.kept == [1, 2, 4] and fit.note.startswith("micro-batch 8 left out: micro-batch 8 would need about 27.9 GB")
    assert "22.0 GB is available" in fit.note
    # two copies at once (hetrain profile --concurrent 2) need twice the room
    fit = host_micro_batches([1, 2, 4, 8], 2.2 * gb, 124_000_000, copies=2, available=22 * gb)
    assert fit.kept == [1, 2] and "(2 copies)" in fit.note and fit.left == [4, 8]
    assert host_micro_batches([1, 2], 2.2 * gb, 124_000_000, available=None).kept == [1, 2]


def test_hf_config_builds_the_architecture_it_names_else_an_encoder_stays_an_encoder(tmp_path):
    """A BERT config was profiled as BertLMHeadModel (a causal head that makes the encoder a decoder, with
    transformers' is_decoder warning), where docs/planner.md said AutoModel."""
    from transformers import BertConfig, LlamaConfig

    tiny = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=16)
    BertConfig(**tiny).save_pretrained(tmp_path / "bert")
    BertConfig(**tiny, architectures=["BertForMaskedLM"]).save_pretrained(tmp_path / "mlm")
    LlamaConfig(**tiny).save_pretrained(tmp_path / "llama")
    assert type(hf_module(str(tmp_path / "bert")).module).__name__ == "BertModel"
    assert type(hf_module(str(tmp_path / "mlm")).module).__name__ == "BertForMaskedLM"
    assert type(hf_module(str(tmp_path / "llama")).module).__name__ == "LlamaForCausalLM"


def test_a_plan_saved_into_the_profiles_directory_does_not_break_the_next_plan(tmp_path):
    """plan --profiles dp2 --out dp2/plan.json, then plan --profiles dp2: 'dp2/plan.json: not a device profile'."""
    import json
    import subprocess
    import sys

    from hetrain.workload import profile

    _saved_profile(tmp_path)
    profile(_tiny().module, torch.randn(2, 16), name="tiny").save(tmp_path / "workload.json")

    def plan(*more: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hetrain.cli.main", "plan", "--devices", "cpu:1", "--profiles",
                               str(tmp_path), "--global-batch-size", "4", "--json", *more],
                              capture_output=True, text=True, timeout=300)

    first = plan("--out", str(tmp_path / "plan.json"))
    assert first.returncode == 0, first.stderr
    again = plan("--out", str(tmp_path / "plan-2.json"))
    assert again.returncode == 0, again.stderr
    assert f"hetrain plan: note: {tmp_path / 'plan.json'} is a plan" in again.stderr
    assert json.loads(again.stdout)["ranks"][0]["figures"] == "measured-profile"
