"""A device profile is matched to the model it measured, not only to its name: two models both named
make_model (every --script factory's default) or gpt2 (a folder's name) do not share timings."""

import shutil
import subprocess
import sys

import pytest
import torch

from hetrain.errors import HetrainError
from hetrain.hardware.cluster import cluster_from_devices
from hetrain.planning.planner import plan_job
from hetrain.workload import profile
from hetrain.workload.measure import measure
from hetrain.workload.modules import RunnableModel


def _model(width: int) -> RunnableModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    return RunnableModel("make_model", module, lambda n: torch.randn(n, 16))


def _measured(runnable: RunnableModel, workload_id: str | None):
    prof = measure(runnable, torch.device("cpu"), ["fp32"], [2], repeats=2, budget_s=0.05, blocks=False)
    return prof.model_copy(update={"workload_id": workload_id, "model_params": 16 * 32 + 32 + 32 * 4 + 4})


def test_a_profile_of_another_model_of_the_same_name_is_refused_naming_the_fix():
    small, large = _model(32), _model(64)
    small_w = profile(small.module, small.batch(2), name="make_model")
    large_w = profile(large.module, large.batch(2), name="make_model")
    assert small_w.identity() != large_w.identity() and small_w.name == large_w.name
    cpu = _measured(small, small_w.identity())
    cluster = cluster_from_devices("cpu:1")
    assert plan_job(cluster, small_w, 8, profiles={"cpu": cpu}).plan.ranks[0].share == 8
    with pytest.raises(HetrainError, match=r"the cpu profile measured another model named 'make_model' \(676 "
                                           r"parameters; the plan's has 1,348\).*fix: re-profile this model into a "
                                           r"fresh directory") as e:
        plan_job(cluster, large_w, 8, profiles={"cpu": cpu})
    assert "\n" not in str(e.value)


def test_a_profile_that_does_not_record_its_model_is_used_with_a_note():
    small = _model(32)
    workload = profile(small.module, small.batch(2), name="make_model")
    result = plan_job(cluster_from_devices("cpu:1"), workload, 8, profiles={"cpu": _measured(small, None)})
    assert result.figures["cpu"] == "measured-profile"
    assert any("its profile does not record which model 'make_model' it measured" in n and
               "re-profile into a fresh --out directory" in n for n in result.plan.notes)


def test_plan_refuses_a_profile_hetrain_profile_wrote_for_another_script_of_the_same_name(tmp_path):
    for width in (32, 64):
        (tmp_path / f"net{width}.py").write_text(
            "import torch\n\ndef make_model():\n    return torch.nn.Sequential(torch.nn.Linear(16, "
            f"{width}), torch.nn.Linear({width}, 4)), lambda n: torch.randn(n, 16)\n")
        p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "profile", "--script",
                            f"{tmp_path / f'net{width}.py'}:make_model", "--device", "cpu", "--micro-batches", "2",
                            "--repeats", "2", "--seconds", "0.1", "--no-blocks", "--out", str(tmp_path / f"p{width}")],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    shutil.copy(tmp_path / "p32" / "cpu.json", tmp_path / "p64" / "cpu.json")   # a profile of the other model
    p = subprocess.run([sys.executable, "-m", "hetrain.cli.main", "plan", "--devices", "cpu:1", "--profiles",
                        str(tmp_path / "p64"), "--global-batch-size", "8"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "another model named 'make_model'" in p.stderr and "--profiles NEW_DIR" in p.stderr


class _Keywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 8)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, input_ids=None, pixels=None, flag=False, extra=None):
        h = self.emb(input_ids).mean(1) if input_ids is not None else 0
        if pixels is not None:
            h = h + self.conv(pixels).mean((2, 3))
        if extra is not None:
            h = h * extra["scale"][:, :1]
        return self.head(h)


def _identity(batch) -> str:
    torch.manual_seed(0)
    return profile(_Keywords(), batch, name="make_model").identity()


def test_the_identity_covers_every_input_whatever_a_dicts_key_order():
    """It took the sequence length of a dict's first value only: the id depended on key order, and an
    image size or a first value that is no token tensor did not enter it."""
    ids, pixels = torch.randint(0, 100, (2, 8)), torch.randn(2, 3, 16, 16)
    base = _identity({"input_ids": ids, "pixels": pixels, "flag": False})
    assert _identity({"flag": False, "pixels": pixels, "input_ids": ids}) == base   # key order
    assert _identity({"input_ids": ids[:1], "pixels": pixels[:1]}) == base         # samples do not count
    assert _identity({"input_ids": ids, "pixels": torch.randn(2, 3, 32, 32)}) != base   # image size
    assert _identity({"pixels": pixels, "input_ids": torch.randint(0, 100, (2, 16))}) != base   # length
    assert _identity({"input_ids": ids.int(), "pixels": pixels}) != base             # dtype
    nested = {"input_ids": ids, "extra": {"scale": torch.ones(2, 8)}}
    assert _identity(nested) != _identity({"input_ids": ids, "extra": {"scale": torch.ones(2, 4)}})
    torch.manual_seed(0)
    prof = profile(_Keywords(), {"flag": False, **nested}, name="make_model")
    assert prof.inputs == ["extra.scale: float32[8]", "input_ids: int64[8]"] and prof.seq_len == 8


def test_profiles_written_before_the_inputs_were_recorded_keep_their_ids():
    from hetrain.workload.zoo import get_profile

    # the digests hetrain gave these zoo models before (what their device profiles recorded)
    assert get_profile("gpt2-124m").identity() == "5fdb21a28b92cb03"
    assert get_profile("resnet50").identity() == "ebff5946109388fb"
    small = _model(32)
    workload = profile(small.module, small.batch(2), name="make_model")
    old_workload = workload.model_copy(update={"inputs": None})
    assert old_workload.identity() == workload.identity(inputs=False) != workload.identity()
    cluster = cluster_from_devices("cpu:1")
    # an old workload.json beside its old device profile
    plan_job(cluster, old_workload, 8, profiles={"cpu": _measured(small, old_workload.identity())})
    # a new workload.json beside an old device profile: used, with a note
    result = plan_job(cluster, workload, 8, profiles={"cpu": _measured(small, workload.identity(inputs=False))})
    assert result.figures["cpu"] == "measured-profile"
    assert any("its profile records the parameters of the model 'make_model' it measured, not its inputs" in n
               for n in result.plan.notes)


def test_a_profile_measure_made_with_its_workload_records_the_model():
    """Every profile made through the API (measure(), measure_cpu_copies(): hetrain bench predict's) was
    called one an older hetrain wrote, whose model cannot be checked."""
    from hetrain.workload.measure import measure_cpu_copies

    small = _model(32)
    workload = profile(small.module, small.batch(2), name="make_model")
    timed = measure(small, torch.device("cpu"), ["fp32"], [2], repeats=2, budget_s=0.05, blocks=False,
                    workload=workload)
    copies = measure_cpu_copies(small, 1, 1, ["fp32"], [2], repeats=2, budget_s=0.05, blocks=False, workload=workload)
    for prof in (timed, copies):
        assert (prof.model, prof.model_params, prof.workload_id) == ("make_model", workload.params,
                                                                      workload.identity())
        result = plan_job(cluster_from_devices("cpu:1"), workload, 8, profiles={"cpu": prof})
        assert not any("does not record" in n for n in result.plan.notes), result.plan.notes
    bare = measure(small, torch.device("cpu"), ["fp32"], [2], repeats=2, budget_s=0.05, blocks=False)
    notes = plan_job(cluster_from_devices("cpu:1"), workload, 8, profiles={"cpu": bare}).plan.notes
    assert any("does not record which model" in n for n in notes) and not any("older hetrain" in n for n in notes)
