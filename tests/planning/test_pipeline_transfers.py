"""Pipeline hand-offs between stages are priced as the runtime sends them: in fp32, whatever each stage computes in."""

import pytest

from hetrain.hardware.cluster import Cluster, Node
from hetrain.planning import cost_model as cm
from hetrain.planning.pipeline_planner import transfer_seconds
from hetrain.planning.planner import plan_job
from hetrain.workload import get_profile


def test_a_hand_off_is_priced_at_4_bytes_an_element():
    """A GPT-2 1.5B block output is 1024 x 1600 elements a sample: 6.55 MB in fp32, as the runtime casts stage
    outputs (and sends their gradients back) in fp32; it was priced at the first stage's 16-bit size, half."""
    p = get_profile("gpt2-1.5b")
    bounds = [(0, 20), (20, len(p.blocks))]
    out = p.blocks[19].output_bytes_per_sample / p.activation_dtype_bytes   # elements a sample
    assert out == 1024 * 1600
    assert transfer_seconds(p, bounds, 8, 1e9) == pytest.approx(8 * 4 * out / (1e9 * cm.LINK_EFFICIENCY))


def _two_nodes(gbps: float) -> Cluster:
    return Cluster(name="two", inter_node_gbps=gbps,
                   nodes=[Node(name=n, devices=[{"model": "a100", "count": 1}]) for n in ("a", "b")])


def test_a_bf16_pipeline_pays_its_fp32_hand_offs_in_every_slot():
    """Two A100 nodes (bf16 stages): the same 1F1B layout at 1 Gb/s and at 2 Gb/s differs by (m + p - 1) hand-offs
    at 2 Gb/s, each of fp32 outputs (priced at 16 bits, half that: 1.08 s where the runtime spends 2.16 s)."""
    p = get_profile("gpt2-1.5b")
    slow, fast = (plan_job(_two_nodes(g), p, 64, strategy="pipeline", micro_batch=2).plan for g in (1.0, 2.0))
    assert {r.precision for r in slow.ranks} == {"bf16"}
    assert slow.pipeline == fast.pipeline and slow.pipeline.chunks == 1
    stages = [tuple(s) for s in slow.pipeline.stages]
    slots = slow.pipeline.microbatches + len(stages) - 1
    added = 64 / slow.predicted_samples_per_s - 64 / fast.predicted_samples_per_s
    assert added == pytest.approx(slots * transfer_seconds(p, stages, 2, _two_nodes(2.0).inter_node_bytes_per_s))
