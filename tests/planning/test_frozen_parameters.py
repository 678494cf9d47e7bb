"""Frozen parameters (a fine-tuned head on a frozen backbone) hold weights, but no gradients, no
optimizer state and nothing to all-reduce: the plan prices them so."""

import json

import pytest
import torch
from torch import nn

from hetrain.hardware.cluster import get_preset
from hetrain.planning.cost_model import FRAGMENTATION, OPTIMIZER_STATE_BYTES, allreduce_cost, topology_of
from hetrain.planning.planner import plan_job
from hetrain.workload import WorkloadProfile, profile

WIDTH = 256


class Backbone(nn.Module):
    def __init__(self, freeze: bool):
        super().__init__()
        self.backbone = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 10)
        for p in self.backbone.parameters():
            p.requires_grad_(not freeze)

    def forward(self, x):
        for layer in self.backbone:
            x = torch.relu(layer(x))
        return self.head(x)


def _twins():
    """The frozen model's profile, and its twin that trains every parameter (with the same activations:
    a frozen layer saves less for backward, which the profile measures)."""
    frozen = profile(Backbone(True), torch.randn(2, WIDTH), name="ft")
    full = profile(Backbone(False), torch.randn(2, WIDTH), name="ft")
    twin = frozen.model_copy(update={"trainable_params": full.trainable_params, "matrix_shapes": full.matrix_shapes,
                                     "blocks": [b.model_copy(update={"trainable_params": b.params})
                                                for b in frozen.blocks]})
    return frozen, twin


def test_the_profile_records_the_trained_parameters_and_an_old_profile_trains_all():
    frozen, full = _twins()
    head = WIDTH * 10 + 10
    assert frozen.params == full.params == 4 * (WIDTH * WIDTH + WIDTH) + head
    assert frozen.trained_params == head and full.trained_params == full.params
    assert [b.trained_params for b in frozen.blocks] == [0, 0, 0, 0, head]
    assert frozen.matrix_shapes == [(10, WIDTH)]   # what PowerSGD would compress: the head's gradient
    old = frozen.model_dump(exclude={"trainable_params"})
    assert WorkloadProfile.model_validate(old).trained_params == frozen.params


def test_a_frozen_backbone_plans_less_memory_and_communication_than_its_trained_twin():
    """Both planned alike (1,886,651,430 bytes a rank and 670 ms of all-reduce for an 80 KB gradient)."""
    frozen, full = _twins()
    gone = full.trained_params - frozen.trained_params
    cluster = get_preset("a100x4+v100x4").model_copy(update={"inter_node_gbps": 1.0})
    for optimizer in ("sgd", "adamw"):
        a = plan_job(cluster, frozen, 64, strategy="balanced", optimizer=optimizer)
        b = plan_job(cluster, full, 64, strategy="balanced", optimizer=optimizer)
        # a frozen parameter has no fp32 gradient and no optimizer state (and the allocator's slack on them)
        expected = (4 + OPTIMIZER_STATE_BYTES[optimizer]) * gone * (1 + FRAGMENTATION)
        for ra, rb in zip(a.plan.ranks, b.plan.ranks):
            assert ra.share == rb.share and ra.micro_batch == rb.micro_batch
            if optimizer == "sgd":
                assert rb.memory_bytes - ra.memory_bytes == pytest.approx(expected, abs=2)
            else:   # and AdamW's step temporaries are of the trained parameters only
                assert rb.memory_bytes - ra.memory_bytes > expected
        # the gradient all-reduce sends the head's gradient only (1% of the parameters)
        exposed = {c.strategy: c.exposed_comm_seconds for c in a.candidates}
        twin = {c.strategy: c.exposed_comm_seconds for c in b.candidates}
        for strategy in ("ddp", "balanced"):
            assert exposed[strategy] < twin[strategy] / 10
        # ZeRO-1 adds its broadcast after the step of every parameter the optimizer holds, frozen ones included
        broadcast = allreduce_cost(4.0 * frozen.params, topology_of(cluster), factor=1.0).seconds
        for figures in (exposed, twin):
            assert figures["zero1"] == pytest.approx(figures["ddp"] + broadcast, rel=1e-9)
        assert not any("PowerSGD" in n for n in a.plan.notes) and any("PowerSGD" in n for n in b.plan.notes)


def test_a_frozen_stage_of_a_pipeline_holds_weights_but_no_gradients():
    frozen, full = _twins()
    from hetrain.planning.cost_model import memory_estimate

    first = memory_estimate(frozen, "fp32", 1, optimizer="sgd", blocks=slice(0, 2))
    twin = memory_estimate(full, "fp32", 1, optimizer="sgd", blocks=slice(0, 2))
    assert first.weights == twin.weights and first.gradients == first.optimizer == 0
    assert twin.gradients == 4 * full.held_params(0, 2)


class TiedHead(nn.Module):
    """A frozen embedding tied to the vocabulary head (the head block holds the embedding's weight again)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight
        self.emb.weight.requires_grad_(False)

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def test_a_frozen_tied_weight_is_held_but_not_trained_on_the_stage_holding_its_copy():
    """The head's stage priced the frozen tied embedding as trained: 64,000 trained there, 4,160 in the model."""
    from hetrain.planning.cost_model import memory_estimate

    tied = profile(TiedHead(), torch.randint(0, 1000, (2, 8)), name="tied")
    assert tied.trained_params == 64 * 64 + 64
    assert tied.blocks[2].tied_params == 64000 and tied.blocks[2].tied_trainable_params == 0
    assert tied.held_params(2, 3) == 64000 and tied.held_trained_params(2, 3) == 0
    assert tied.held_trained_params(0, 2) + tied.held_trained_params(2, 3) == tied.trained_params
    head = memory_estimate(tied, "fp32", 1, optimizer="adamw", blocks=slice(2, 3))
    assert head.weights == 4 * 64000 and head.gradients == head.optimizer == 0
    old = tied.model_copy(update={"blocks": [b.model_copy(update={"tied_trainable_params": None})
                                             for b in tied.blocks]})
    assert old.held_trained_params(2, 3) == 64000   # a profile without the count trains its tied copy, as before


def test_a_profile_that_trains_nothing_is_refused_in_one_line():
    """It planned without complaint, though the runtime refuses a model with nothing to train."""
    from hetrain.errors import HetrainError
    from hetrain.hardware.cluster import cluster_from_devices

    frozen, _ = _twins()
    none = frozen.model_copy(update={"trainable_params": 0,
                                     "blocks": [b.model_copy(update={"trainable_params": 0}) for b in frozen.blocks]})
    with pytest.raises(HetrainError, match=r"model 'ft' has no parameter that takes a gradient \(its profile's "
                                           r"trainable_params is 0\)") as e:
        plan_job(cluster_from_devices("a100:2"), none, 8)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("where", ["model", "block", "tied"])
def test_a_profile_training_more_parameters_than_it_has_is_refused(tmp_path, where):
    from hetrain.errors import HetrainError

    data = profile(TiedHead(), torch.randint(0, 1000, (2, 8)), name="tied").model_dump()
    if where == "model":
        data["trainable_params"] = data["params"] * 10
    elif where == "block":
        data["blocks"][1]["trainable_params"] = data["blocks"][1]["params"] + 1
    else:
        data["blocks"][2]["tied_trainable_params"] = data["blocks"][2]["tied_params"] + 1
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HetrainError, match=r"is not a workload profile: .*trainable_params \d+ is more than") as e:
        WorkloadProfile.load(path)
    assert "\n" not in str(e.value)


def test_a_model_training_all_its_parameters_gets_the_optimizer_step_it_got_before_to_the_last_bit():
    """Scaling the step by trained / params moved 415 of 4,624 figures by one unit in the last place."""
    from hetrain.hardware.catalog import load_catalog
    from hetrain.planning.cost_model import OPTIMIZER_STEP_BYTES, optimizer_seconds
    from hetrain.workload.zoo import get_profile, zoo_names

    specs = list(load_catalog().values())
    for name in zoo_names():
        prof = get_profile(name)
        for spec in specs:
            for optimizer, step_bytes in OPTIMIZER_STEP_BYTES.items():
                before = step_bytes * prof.params / spec.mem_bw_bytes_per_s   # the formula before frozen parameters
                assert optimizer_seconds(prof, spec, optimizer) == before, (name, spec.name, optimizer)


# Each path that prices frozen parameters apart, each with a test that fails where it prices them as trained.

def test_a_pipeline_stage_profile_trains_only_the_trained_parameters_it_holds():
    from hetrain.planning.pipeline_planner import stage_profile

    frozen, full = _twins()
    head = WIDTH * 10 + 10
    assert stage_profile(frozen, 0, 2).trained_params == 0 and stage_profile(frozen, 2, 5).trained_params == head
    assert stage_profile(full, 0, 2).trained_params == full.held_params(0, 2)


def test_a_pipeline_stage_of_frozen_blocks_takes_no_optimizer_step():
    """Each rank's step is its stage's micro-batches plus its stage's optimizer step, of the trained
    parameters it holds: none on the frozen stage, the whole model's on the head's."""
    from hetrain.hardware.cluster import cluster_from_devices
    from hetrain.hardware.catalog import get_gpu
    from hetrain.planning.cost_model import optimizer_seconds

    frozen, full = _twins()
    a100 = get_gpu("a100")
    a = plan_job(cluster_from_devices("a100:2"), frozen, 64, strategy="pipeline", optimizer="adamw")
    b = plan_job(cluster_from_devices("a100:2"), full, 64, strategy="pipeline", optimizer="adamw")
    assert a.plan.pipeline.stages == b.plan.pipeline.stages
    (s0, e0), (s1, e1) = a.plan.pipeline.stages
    twin_step = optimizer_seconds(full, a100, "adamw")
    twin_opt = [twin_step * full.held_params(s, e) / full.params for s, e in ((s0, e0), (s1, e1))]
    frozen_opt = [0.0, optimizer_seconds(frozen, a100, "adamw")]   # every trained parameter is the head's stage's
    for ra, rb in zip(a.plan.ranks, b.plan.ranks):   # the same micro-batches: the steps differ by the optimizer's
        j = ra.stage
        assert ra.micro_batch == rb.micro_batch and ra.activation_checkpointing == rb.activation_checkpointing
        assert ra.predicted_step_seconds - frozen_opt[j] == pytest.approx(rb.predicted_step_seconds - twin_opt[j],
                                                                          rel=1e-12)


def test_pipeline_replicas_sum_only_the_trained_gradients():
    """Four replicas of a 2-stage pipeline over a 1 Gbit/s network: the twin's step is its gradient sum."""
    frozen, full = _twins()
    cluster = get_preset("a100x4+v100x4").model_copy(update={"inter_node_gbps": 1.0})
    steps = []
    for prof in (frozen, full):
        hybrid = {c.strategy: c for c in plan_job(cluster, prof, 64, strategy="pipeline").candidates}["hybrid"]
        assert hybrid.plan is not None and hybrid.plan.pipeline.stages == [[0, 3], [3, 5]]
        steps.append(hybrid.step_seconds)
    assert steps[0] < steps[1] / 5


def test_zero3_reduce_scatters_only_the_trained_gradients():
    """FSDP gathers every weight but reduce-scatters the trained ones' gradients only."""
    frozen, full = _twins()
    cluster = get_preset("a100x4+v100x4").model_copy(update={"inter_node_gbps": 1.0})
    topo = topology_of(cluster)
    exposed = [{c.strategy: c for c in plan_job(cluster, p, 64, strategy="zero3").candidates}["zero3"]
               for p in (frozen, full)]
    assert [r.grad_accum for r in exposed[0].plan.ranks] == [r.grad_accum for r in exposed[1].plan.ranks] == [1] * 8
    saved = (allreduce_cost(4.0 * full.params, topo, factor=1.0).seconds
             - allreduce_cost(4.0 * frozen.trained_params, topo, factor=1.0).seconds)
    # the rest of the difference: the slow rank's optimizer step, which hides as much comm under it
    assert exposed[1].exposed_comm_seconds - exposed[0].exposed_comm_seconds == pytest.approx(saved, rel=0.02)


def test_measured_peaks_leave_out_the_gradients_of_the_trained_parameters_only():
    """A device profile's peak holds the weights, the trained parameters' gradients and the activations:
    what is left of it is the activations."""
    from hetrain.hardware.cluster import cluster_from_devices
    from hetrain.planning.cost_model import default_calibration, state_bytes
    from hetrain.planning.kinds import kinds_of
    from hetrain.workload.device_profile import DeviceProfile, Stamp, StepTiming

    frozen, _ = _twins()
    weights, grads, _ = state_bytes(frozen.params, "bf16", "sgd-nomomentum", trained=frozen.trained_params)
    assert grads == 4 * frozen.trained_params
    per_sample = 20_000.0
    prof = DeviceProfile(model="ft", device="a100-sxm4-80gb", optimizer_seconds=0.001,
                         stamp=Stamp(device_name="NVIDIA A100-SXM4-80GB", torch="2.5", date="2026-01-01T00:00:00Z"),
                         steps=[StepTiming(precision="bf16", micro_batch=mb, seconds=0.001 * mb,
                                           peak_memory_bytes=int(weights + grads + per_sample * mb)) for mb in (8, 32)])
    kind, = kinds_of(cluster_from_devices("a100:1"), frozen, "bf16", default_calibration(),
                     profiles={"a100-sxm4-80gb": prof}, optimizer="adamw")
    assert kind.activations(frozen, 16, False) == pytest.approx(16 * per_sample, abs=1)
