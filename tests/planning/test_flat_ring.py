"""A flat ring all-reduce over several nodes runs at its slowest link, inside a node or between nodes."""

import pytest

from hetrain.hardware.cluster import Cluster, Node
from hetrain.planning import cost_model as cm
from hetrain.planning.planner import plan_job
from hetrain.workload import get_profile

BERT_GRADIENTS = 4.0 * get_profile("bert-large").trained_params   # 1.34 GB


def test_a_flat_ring_through_pcie_nodes_runs_at_pcie_not_at_the_network():
    """Two nodes of 4 PCIe Gen3 GPUs (15.75 GB/s) on a 400 Gb/s network: the ring through all 8 ranks crosses
    3 PCIe hops in each node for each network hop; priced at the network it took 58.9 ms, at PCIe 186.4 ms
    (the two-level all-reduce, 193 ms, is slower still)."""
    topo = cm.CommTopology((4, 4), intra_bytes_per_s=15.75e9, inter_bytes_per_s=50e9)
    c = cm.allreduce_cost(BERT_GRADIENTS, topo)
    assert c.algorithm == "ring"
    assert c.seconds == pytest.approx(cm.ring_seconds(BERT_GRADIENTS, 8, 15.75e9, cm.LATENCY_INTER_S))
    assert c.seconds == pytest.approx(0.1864, abs=1e-4) and c.inter_node_seconds == c.seconds
    # a gather or reduce-scatter over the same ranks (factor 1, as FSDP2's) the same way
    half = cm.allreduce_cost(BERT_GRADIENTS, topo, factor=1.0).seconds
    assert half == pytest.approx(cm.ring_seconds(BERT_GRADIENTS, 8, 15.75e9, cm.LATENCY_INTER_S, 1.0))


def test_nodes_whose_own_links_outrun_the_network_keep_the_network_rate():
    topo = cm.CommTopology((1, 1, 1, 1), intra_bytes_per_s=float("inf"), inter_bytes_per_s=12.5e9)
    assert cm.allreduce_cost(BERT_GRADIENTS, topo).seconds == pytest.approx(
        cm.ring_seconds(BERT_GRADIENTS, 4, 12.5e9, cm.LATENCY_INTER_S))
    nvlink = cm.CommTopology((8, 8), intra_bytes_per_s=300e9, inter_bytes_per_s=50e9)
    flat = cm.ring_seconds(BERT_GRADIENTS, 16, 50e9, cm.LATENCY_INTER_S)
    assert cm.allreduce_cost(BERT_GRADIENTS, nvlink).seconds <= flat


def test_a_plan_over_pcie_nodes_compresses_where_their_ring_is_the_bottleneck():
    """4 A100 PCIe and 4 T4 on two nodes at 400 Gb/s, BERT-large at 256: the plan saw 1.2 ms of the all-reduce
    exposed and said no compression was needed; over PCIe it is 186 ms, and a 16-bit all-reduce is faster."""
    cluster = Cluster(name="pcie2node", inter_node_gbps=400, nodes=[
        Node(name="a100box", devices=[{"model": "a100-pcie-80gb", "count": 4}]),
        Node(name="t4box", devices=[{"model": "t4", "count": 4}])])
    result = plan_job(cluster, get_profile("bert-large"), 256)
    plain = next(c for c in result.candidates if c.strategy == "balanced")
    assert result.plan.strategy == "balanced" and result.plan.comm.compression == "fp16"
    assert any("predicted none" in n and "chose fp16" in n for n in result.notes), result.notes
    assert plain.exposed_comm_seconds > 0.01
