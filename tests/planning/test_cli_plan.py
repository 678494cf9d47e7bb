"""`hetrain plan` and `hetrain simulate` as a user runs them."""

import json
import subprocess
import sys

import pytest

from hetrain.errors import HetrainError
from hetrain.planning.cost_model import data_parallel_efficiency
from hetrain.planning.plan import Plan


def _run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hetrain.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_plan_json_and_out(tmp_path):
    out = tmp_path / "plan.json"
    p = _run("plan", "--preset", "a100x4+v100x4", "--model", "resnet152", "--global-batch", "1024", "--json",
             "--out", str(out))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for key in ("strategy", "predicted_samples_per_s", "uniform_ddp_samples_per_s", "ideal_samples_per_s",
                "ranks", "candidates", "notes", "plan"):
        assert key in d
    for r in d["ranks"]:
        assert {"device", "precision", "micro_batch", "grad_accum", "activation_checkpointing", "memory_bytes",
                "memory_capacity_bytes"} <= set(r)
    # The ideal has no communication and no synchronisation loss; the plan loses that loss and little else.
    kept = data_parallel_efficiency(len(d["ranks"]))
    assert d["predicted_samples_per_s"] >= 0.9 * kept * d["ideal_samples_per_s"]
    assert d["predicted_samples_per_s"] > d["uniform_ddp_samples_per_s"]
    assert Plan.load(out).global_batch_size == 1024


@pytest.mark.parametrize("args", [
    ("--preset", "nope", "--model", "resnet50", "--global-batch", "64"),
    ("--preset", "a100x8", "--model", "nope", "--global-batch", "64"),
    ("--preset", "a100x8", "--model", "resnet50", "--global-batch", "0"),
    ("--preset", "a100x8", "--model", "resnet50", "--global-batch", "-5"),
    ("--devices", "", "--model", "resnet50", "--global-batch", "64"),
    ("--devices", "t4:1", "--model", "llama-7b", "--global-batch", "8"),
])
def test_bad_input_is_one_line_exit_2(args):
    p = _run("plan", *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetrain plan: error:"), p.stderr


@pytest.mark.parametrize("args, named", [
    (("--preset", "nope", "--model", "resnet50"), "unknown preset 'nope'"),
    (("--devices", "a100:1,v100:1", "--model", "nope"), "unknown model 'nope'; choose one of: bert-base"),
    (("--devices", "a100:1,v100:1", "--model", "nope"), "or pass --profile FILE (a saved profile) or --profiles DIR"),
    (("--devices", "a100:1,v100:1", "--model", "resnet50"), "--global-batch-size is required"),
])
def test_the_first_mistake_is_the_one_reported(args, named):
    """Without a batch size, an unknown preset or model is still what the error names."""
    p = _run("plan", *args)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert named in p.stderr, p.stderr


def test_simulate_writes_png_and_csv(tmp_path):
    prefix = tmp_path / "sim"
    p = _run("simulate", "--model", "resnet50", "--sizes", "1,2,4", "--out", str(prefix))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"
    rows = (tmp_path / "sim.csv").read_text().splitlines()
    assert rows[0].startswith("devices,strategy") and len(rows) > 3


def test_simulate_out_may_name_the_png(tmp_path):
    (tmp_path / "sweep").mkdir()   # a directory of the prefix's name changes nothing (second review)
    p = _run("simulate", "--model", "resnet50", "--sizes", "1,2", "--out", str(tmp_path / "sweep.png"))
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["sweep", "sweep.csv", "sweep.png"]


@pytest.mark.parametrize("given", ["out/", "out"])
def test_simulate_out_may_name_a_directory(tmp_path, given):
    """`--out out/` wrote the hidden files out/.csv and out/.png.png, and said it wrote out/.csv and out/.png."""
    (tmp_path / "out").mkdir()
    p = _run("simulate", "--model", "resnet50", "--sizes", "1", "--out", given, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == ["simulate.csv", "simulate.png"]
    assert "wrote out/simulate.csv and out/simulate.png" in p.stdout.replace("//", "/"), p.stdout


def test_simulate_bare_runs_the_default_example_and_marks_the_chosen_strategy(tmp_path):
    p = _run("simulate", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    import csv

    rows = list(csv.DictReader((tmp_path / "simulate.csv").open()))
    sizes = {r["devices"] for r in rows}
    chosen = [r for r in rows if r["chosen"] == "True"]
    assert len(sizes) >= 4 and sorted(r["devices"] for r in chosen) == sorted(sizes)  # one chosen per size


def test_global_batch_size_is_the_flag_and_global_batch_its_alias():
    a = _run("plan", "--devices", "a100:1,v100:1", "--model", "resnet50", "--global-batch-size", "256", "--json")
    b = _run("plan", "--devices", "a100:1,v100:1", "--model", "resnet50", "--global-batch", "256", "--json")
    assert a.returncode == 0 and b.returncode == 0
    assert json.loads(a.stdout)["plan"] == json.loads(b.stdout)["plan"]


def test_piped_tables_keep_their_headings_whole():
    """Into a file or a pipe, tables take at least 160 columns, not the 80 a console guesses (or a
    parent's readline exports as COLUMNS): no heading is cut to 'memo…'; a wider COLUMNS widens them."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    args = [sys.executable, "-m", "hetrain.cli.main", "plan", "--preset", "a100x4+v100x4", "--model", "resnet50",
            "--global-batch-size", "512"]
    for columns in (None, "80"):
        p = subprocess.run(args, capture_output=True, text=True, timeout=120,
                           env=env if columns is None else {**env, "COLUMNS": columns})
        assert p.returncode == 0, p.stderr
        heading = p.stdout.splitlines()[2]
        assert "memory used / total" in heading and "micro-batch x accum" in heading and "…" not in heading
        assert max(len(line) for line in p.stdout.splitlines()) <= 160
    wide = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**env, "COLUMNS": "220"})
    assert 160 < max(len(line) for line in wide.stdout.splitlines()) <= 220


def test_a_file_that_is_no_workload_profile_is_one_line_naming_the_fix(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    p = _run("plan", "--preset", "a100x8", "--profile", str(bad), "--global-batch-size", "64")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "is not a workload profile: name: Field required; params: Field required" in p.stderr, p.stderr
    assert "more); write one with hetrain profile" in p.stderr, p.stderr
    from hetrain.workload import get_profile

    typo = get_profile("resnet50").model_dump(mode="json")
    typo["parms"] = typo.pop("params")   # the one line names the typo, not 'params: Field required (and 1 more)'
    bad.write_text(json.dumps(typo))
    p = _run("plan", "--preset", "a100x8", "--profile", str(bad), "--global-batch-size", "64")
    assert "is not a workload profile: parms: unknown field; fix: rename it to 'params'; write one" in p.stderr, p.stderr
    bad.write_text("not json")
    p = _run("plan", "--preset", "a100x8", "--profile", str(bad), "--global-batch-size", "64")
    assert p.returncode == 2 and "is not a workload profile: not JSON" in p.stderr, p.stderr


def test_a_micro_batch_larger_than_a_device_holds_caps_that_device_and_keeps_data_parallelism():
    """--micro-batch 64 refused every data-parallel plan because a V100 could not hold 64 (its share was
    18), and auto chose a pipeline at 47.5 samples/s against the 108.7 of balanced, blaming model state."""
    p = _run("plan", "--devices", "a100:1,v100-16gb:1", "--model", "gpt2-124m", "--global-batch-size", "64",
             "--micro-batch", "64", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["strategy"] == "balanced", plan["strategy"]
    v100 = next(r for r in plan["plan"]["ranks"] if r["device"].startswith("v100"))
    held = next(n for n in plan["notes"] if "--micro-batch" in n)
    assert "v100-sxm2-16gb cannot hold the 64 of --micro-batch" in held, held
    # it runs as it would without the flag: the largest pieces it holds without activation checkpointing
    unasked = _run("plan", "--devices", "a100:1,v100-16gb:1", "--model", "gpt2-124m", "--global-batch-size", "64",
                   "--json")
    assert json.loads(unasked.stdout)["plan"]["ranks"] == plan["plan"]["ranks"]
    assert not v100["activation_checkpointing"] and v100["memory_bytes"] <= v100["memory_capacity_bytes"]


def test_a_batch_beyond_counting_and_a_closed_pipe_end_without_a_traceback():
    p = _run("plan", "--devices", "a100:2", "--model", "resnet50", "--global-batch-size", "99999999999999999999")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--global-batch-size must be a positive integer up to" in p.stderr
    shell = subprocess.run(f"{sys.executable} -m hetrain.cli.main devices --preset mix1024 --json | head -c 20",
                           shell=True, capture_output=True, text=True, timeout=120)
    assert shell.stdout.startswith("{") and "Traceback" not in shell.stderr and "Broken" not in shell.stderr, shell.stderr


def test_the_plan_table_names_the_ranks_of_a_row_as_they_are():
    from hetrain.cli.plan import rank_label

    assert [rank_label(r) for r in ([3], [0, 1, 2], [0, 1, 4, 5])] == ["3", "0..2 (3)", "0,1,4,5"]   # was 0..5 (4)
    p = _run("profile", "--model", "resnet50", "--device", "cpu", "--threads", "0", "--out", "unused")
    assert p.returncode == 2 and "--threads 0" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_plan_json_output_saved_to_a_file_is_a_plan_the_launcher_reads(tmp_path):
    """`hetrain plan --json > plan.json` then `hetrain launch --plan plan.json` was refused with a list of
    'Field required' errors; the file's plan is used."""
    p = _run("plan", "--devices", "a100:1,v100:1", "--model", "resnet50", "--global-batch", "256", "--json")
    (tmp_path / "plan.json").write_text(p.stdout)
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.shares == [r["share"] for r in json.loads(p.stdout)["ranks"]] and plan.global_batch_size == 256


def test_an_edit_to_the_summary_of_plan_json_output_alone_is_refused_not_ignored(tmp_path):
    """`hetrain plan --json` prints a summary (strategy, ranks) above the plan launch runs: shares edited in the
    summary, the first `ranks` a user sees, were ignored, and the job ran the old split without a word."""
    p = _run("plan", "--devices", "a100:1,v100:1", "--model", "resnet50", "--global-batch", "128", "--json")
    doc = json.loads(p.stdout)
    old = [r["share"] for r in doc["ranks"]]
    doc["ranks"][0]["share"], doc["ranks"][1]["share"] = 100, 28
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(HetrainError, match=rf"its summary at the top differs from the `plan` below it, which is what "
                                           rf"runs \(rank 0 share 100 against {old[0]}; rank 1 share 28 against "
                                           rf"{old[1]}\); make the edit under \"plan\""):
        Plan.load(tmp_path / "plan.json")
    def whole_as_int(value):   # as a tool that rewrites numbers (jq 1.6) writes 25.0: 25
        if isinstance(value, dict):
            return {k: whole_as_int(v) for k, v in value.items()}
        if isinstance(value, list):
            return [whole_as_int(v) for v in value]
        return int(value) if isinstance(value, float) and value.is_integer() else value

    (tmp_path / "plan.json").write_text(json.dumps(whole_as_int(doc)))
    with pytest.raises(HetrainError, match="its summary at the top differs"):
        Plan.load(tmp_path / "plan.json")
    for row, rank in zip(doc["ranks"], doc["plan"]["ranks"]):   # the same edit made in both places runs
        rank["share"] = row["share"]
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    assert Plan.load(tmp_path / "plan.json").shares == [100, 28]
    doc = json.loads(p.stdout)   # an edit under "plan" alone, where docs/planner.md says launch reads it, runs
    doc["plan"]["ranks"][0]["share"], doc["plan"]["ranks"][1]["share"] = 80, 48
    doc["plan"]["ranks"][1]["precision"] = "fp32"
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    assert Plan.load(tmp_path / "plan.json").shares == [80, 48]


def test_a_key_written_twice_in_a_plan_is_refused(tmp_path):
    """json keeps the last of two equal keys: a rank with "precision" twice ran in the second without a word."""
    text = ('{"version": 1, "global_batch_size": 128, "ranks": [{"rank": 0, "share": 64}, '
            '{"rank": 1, "share": 64, "precision": "bf16", "precision": "fp32"}]}')
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(HetrainError, match=rf"^{tmp_path / 'plan.json'}: key 'precision' appears twice in one "
                                           r"object \(rank 1\); fix: keep one$"):
        Plan.load(tmp_path / "plan.json")


def test_files_of_another_kind_say_what_they_are_not(tmp_path):
    """A plan given as a cluster file was told to rename 'strategy' to 'nodes'; a file that is no device profile
    or measured rates got a list of 'Field required'; a model name typed wrong named no candidate."""
    plan = tmp_path / "plan.json"
    assert _run("plan", "--devices", "a100:1", "--model", "resnet50", "--global-batch", "64", "--out",
                str(plan)).returncode == 0
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "a100.json").write_text(json.dumps({"name": "x", "params": 3}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "measured-rates.json").write_text(json.dumps({"rates": {}}))
    m = ("--model", "resnet50", "--global-batch", "64")
    for args, said in [
        (("--cluster", str(plan), *m), "this is a plan (hetrain plan's output), not a cluster file; fix: pass it "
                                       "to `hetrain launch --plan`"),
        (("--devices", "a100:1", "--profiles", str(tmp_path / "profiles"), *m),
         "holds no device profiles (a100.json is a workload profile, left out); run hetrain profile --out"),
        (("--devices", "a100:1", "--from-run", str(tmp_path / "run"), *m), "not the measured rates a hetrain run writes"),
        (("--devices", "a100:1", "--model", "resnt50", "--global-batch", "64"), "closest: resnet50"),
        (("--devices", "a100:1", "--strategy", "fast", *m), "invalid choice: 'fast'"),   # argparse: 11 lines before
    ]:
        r = _run("plan", *args)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and said in lines[0], (args, r.stderr)


def test_a_plan_with_its_required_fields_misspelt_is_told_the_renames_not_that_it_is_no_plan(tmp_path):
    """Two required fields written wrong made 'not a plan: hetrain plan --out FILE writes one', hiding the
    rename the message gave before."""
    (tmp_path / "plan.json").write_text(json.dumps({"global_batch": 8, "rank": [], "strategy": "balanced"}))
    with pytest.raises(Exception) as e:
        Plan.load(tmp_path / "plan.json")
    assert "rename it to 'global_batch_size'" in str(e.value) and "not a plan" not in str(e.value)


def test_a_hybrid_plan_no_grid_allows_says_so_not_that_memory_lacks():
    """Two A100s hold GPT-2 124M with room to spare, and hybrid was said to "lack memory": one device per
    replica is no hybrid at all."""
    p = _run("plan", "--devices", "a100-sxm4-80gb:2", "--model", "gpt2-124m", "--strategy", "pipeline",
             "--global-batch-size", "64", "--json")
    assert p.returncode == 0, p.stderr
    reasons = {c["strategy"]: c.get("reason") for c in json.loads(p.stdout)["candidates"]}
    assert "each replica would hold one device" in reasons["hybrid"], reasons
    assert "memory" not in reasons["hybrid"]
