"""A plan runs as written, or is refused in one line naming the fix: device aliases, strategy against
sharding, islands against the plan's ranks, and the CPU threads a plan's note asks to profile with."""

import json
import os

import pytest

from hetrain.errors import HetrainError
from hetrain.hardware.cluster import cluster_from_devices, get_preset
from hetrain.planning.plan import Plan
from hetrain.planning.planner import plan_job
from hetrain.runtime.plan_entries import assign_entries, comm_for_world, emulated_kinds
from hetrain.vocabulary import Env
from hetrain.workload import get_profile
from hetrain.workload.device_profile import DeviceProfile, Stamp, StepTiming


def _doc(**top) -> dict:
    """A two-rank plan as `hetrain plan --devices a100:1,v100:1` writes it, with `top` changed."""
    return {"global_batch_size": 128, "balance": {"enabled": False}, "ranks": [
        {"rank": 0, "device": "a100-sxm4-80gb", "share": 96, "precision": "bf16"},
        {"rank": 1, "device": "v100-sxm2-32gb", "share": 32, "precision": "fp16"}], **top}


def _aliased(v100_precision: str = "fp16") -> str:
    doc = _doc()
    doc["ranks"][0]["device"], doc["ranks"][1]["device"] = "a100", "v100"
    doc["ranks"][1]["precision"] = v100_precision
    return json.dumps(doc)


def test_a_device_alias_is_refused_bf16_as_its_catalog_name_is():
    """bf16 on "v100" was accepted, where on "v100-sxm2-32gb" it is refused."""
    with pytest.raises(HetrainError, match=r"^plan\.json: ranks\.1: precision bf16 on v100-sxm2-32gb, which has no "
                                           r"bf16: use fp16 .* or fp32, or re-plan with hetrain plan$"):
        Plan.from_json(_aliased("bf16"), source="plan.json")


def test_ranks_find_the_entries_a_plan_names_by_alias(monkeypatch):
    """Ranks standing in for an A100 and a V100 found no entry in a plan naming "a100" and "v100"."""
    monkeypatch.setenv(Env.EMULATE_DEVICES, "a100,v100")
    got = assign_entries(Plan.from_json(_aliased()), emulated_kinds(), [True, True])
    assert [(e.share, e.precision) for e in got.entries] == [(96, "bf16"), (32, "fp16")] and not got.resplit
    # cpu and names the catalog lacks stay as written
    doc = _doc()
    doc["ranks"][0]["device"], doc["ranks"][1]["device"] = "cpu", "my-own-gpu"
    assert [r.device for r in Plan.from_json(json.dumps(doc)).ranks] == ["cpu", "my-own-gpu"]


@pytest.mark.parametrize("strategy,sharding,fix", [
    ("zero3", "none", "set \"sharding\" to 'fsdp', or \"strategy\" to 'balanced'"),
    ("ddp", "fsdp", "set \"sharding\" to 'none', or \"strategy\" to 'zero3'"),
    ("balanced", "zero1", "set \"sharding\" to 'none', or \"strategy\" to 'zero1'"),
    ("zero1", "fsdp", "set \"sharding\" to 'zero1' or 'zero1-proportional', or \"strategy\" to 'zero3'"),
])
def test_a_strategy_its_sharding_does_not_run_is_refused_in_one_line(strategy, sharding, fix):
    """"strategy": "zero3" with "sharding": "none" ran plain DDP without a word."""
    with pytest.raises(HetrainError) as caught:
        Plan.from_json(json.dumps(_doc(strategy=strategy, sharding=sharding)), source="plan.json")
    message = str(caught.value)
    assert "\n" not in message and f"strategy {strategy!r} runs sharding" in message and message.endswith(fix), message


def test_plans_whose_strategy_and_sharding_agree_load():
    for strategy, sharding in (("ddp", "none"), ("balanced", "none"), ("zero1", "zero1"),
                               ("zero1", "zero1-proportional"), ("zero3", "fsdp")):
        assert Plan.from_json(json.dumps(_doc(strategy=strategy, sharding=sharding))).sharding == sharding
    # a plan naming only its sharding takes that sharding's strategy
    assert Plan.from_json(json.dumps(_doc(sharding="fsdp"))).strategy == "zero3"
    assert Plan.from_json(json.dumps(_doc())).strategy == "balanced"


@pytest.mark.parametrize("strategy", ["auto", "ddp", "balanced", "zero1", "zero3", "pipeline"])
def test_every_plan_the_planner_writes_loads_back(strategy):
    result = plan_job(get_preset("a100x4+v100x4"), get_profile("resnet152"), 1024, strategy=strategy)
    again = Plan.from_json(result.plan.to_json())
    assert (again.strategy, again.sharding) == (result.plan.strategy, result.plan.sharding)


@pytest.mark.parametrize("islands", [[[0, 1, 2]], [[0], [-1]], [[0], [1, 2]]])
def test_islands_naming_a_rank_the_plan_lacks_are_refused_in_one_line(islands):
    """They crashed with a raw KeyError where an island missing a rank got this line."""
    plan = Plan.from_json(json.dumps(_doc(comm={"hierarchical": True, "islands": islands})))
    with pytest.raises(HetrainError, match=r"^comm\.islands=.* must name every rank 0\.\.1 exactly once, in non-empty "
                                           r"islands; fix the islands to match the world size$"):
        comm_for_world(plan, assign_entries(plan, [r.device for r in plan.ranks]))


def test_islands_without_a_two_level_all_reduce_change_nothing():
    plan = Plan.from_json(json.dumps(_doc(comm={"hierarchical": False, "islands": [[0, 1, 2]]})))
    comm, note = comm_for_world(plan, assign_entries(plan, [r.device for r in plan.ranks]))
    assert not comm.hierarchical and note is None


def test_a_cpu_beside_a_gpu_is_told_the_threads_launch_gives_it(monkeypatch):
    """hetrain launch gives each of a node's ranks, its GPU ranks included, cores / ranks threads: a CPU
    beside an A100 on 8 cores runs on 4, and the note said 8."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    def notes(threads: int) -> list[str]:
        stamp = Stamp(device_name="cpu", torch="2.13.0", threads=threads, concurrent_copies=1,
                      date="2026-01-01T00:00:00+00:00")
        prof = DeviceProfile(model="resnet50", device="cpu", stamp=stamp, optimizer_seconds=0.01,
                             steps=[StepTiming(precision="fp32", micro_batch=b, seconds=0.05 * b) for b in (4, 16)])
        result = plan_job(cluster_from_devices("cpu:1,a100:1"), get_profile("resnet50"), 64, profiles={"cpu": prof})
        assert result.figures["cpu"] == "measured-profile"
        return [n for n in result.plan.notes if "the profile timed" in n]

    [note] = notes(threads=8)
    assert "runs 1 rank(s) on a node beside 1 other rank(s), 4 thread(s) each" in note, note
    assert note.endswith("`hetrain profile --device cpu --concurrent 1 --threads 4`"), note
    assert notes(threads=4) == []
