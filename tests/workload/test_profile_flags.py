"""hetrain profile's flags say what they do not apply to, and its refusals name the flag that fixes them."""

import subprocess
import sys

import pytest
import torch

from hetrain.cli import profile as profile_cli
from hetrain.errors import HetrainError
from hetrain.hardware.cluster import cluster_from_devices
from hetrain.planning.planner import plan_job
from hetrain.workload import profile
from hetrain.workload.measure import measure
from hetrain.workload.modules import RunnableModel


def test_seq_len_with_a_script_or_a_zoo_model_is_refused_not_ignored(tmp_path):
    script = tmp_path / "net.py"
    script.write_text("import torch\n\ndef make_model():\n    return torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4)\n")
    for what in (("--script", str(script)), ("--model", "resnet50")):
        p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", *what, "--seq-len", "128",
                            "--device", "cpu", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert "--seq-len 128 applies to --hf-config only" in p.stderr and "leave out --seq-len" in p.stderr
    assert not (tmp_path / "out").exists()


def test_micro_batches_that_fit_no_host_memory_name_smaller_micro_batches(monkeypatch):
    """--micro-batches 1000000 was told 'a shorter --seq-len or a smaller model'."""
    monkeypatch.setattr("hetrain.hardware.catalog.host_available_bytes", lambda: 1e8)
    workload = profile(torch.nn.Linear(64, 64), torch.randn(2, 64))
    with pytest.raises(HetrainError, match=r"micro-batch 1000000 would need .*; fix: smaller --micro-batches"):
        profile_cli._host_micro_batches([1000000], workload, 1)


def test_a_profile_of_a_device_the_plan_does_not_use_is_named_in_a_note():
    runnable = RunnableModel("lin", torch.nn.Linear(8, 2), lambda n: torch.randn(n, 8))
    workload = profile(runnable.module, runnable.batch(2), name="lin")
    cpu = measure(runnable, torch.device("cpu"), ["fp32"], [2], repeats=2, budget_s=0.05, blocks=False)
    cpu = cpu.model_copy(update={"workload_id": workload.identity()})
    result = plan_job(cluster_from_devices("a100:1"), workload, 8, profiles={"cpu": cpu})
    assert "cpu: profiled, but not among this plan's devices: its profile is unused" in result.plan.notes


def test_the_profile_table_says_1_thread(capsys, tmp_path):
    runnable = RunnableModel("lin", torch.nn.Linear(8, 2), lambda n: torch.randn(n, 8))
    prof = measure(runnable, torch.device("cpu"), ["fp32"], [2], repeats=2, budget_s=0.05, blocks=False)
    prof = prof.model_copy(update={"stamp": prof.stamp.model_copy(update={"threads": 1})})
    profile_cli._print([(tmp_path / "cpu.json", prof)])
    out = capsys.readouterr().out
    assert "1 thread" in out and "1 threads" not in out
