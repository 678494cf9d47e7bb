"""The cluster file: ranks, islands, links, round-trip, one-line errors, presets."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from hetrain.errors import HetrainError
from hetrain.hardware.catalog import get_gpu
from hetrain.hardware.cluster import (
    PRESETS,
    Cluster,
    Node,
    cluster_from_devices,
    dump_cluster,
    get_preset,
    load_cluster,
    save_cluster,
)

LAB = """\
name: lab
inter_node_gbps: 100
nodes:
  - name: dgx
    devices:
      - model: a100
        count: 4
  - name: box
    devices:
      - {model: V100-SXM2-32GB, count: 2}
      - model: t4
"""


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_ranks_islands_links(tmp_path: Path) -> None:
    cluster = load_cluster(_write(tmp_path, LAB))
    devices = cluster.devices()
    assert [d.rank for d in devices] == list(range(7))
    assert [d.spec.name for d in devices] == ["a100-sxm4-80gb"] * 4 + ["v100-sxm2-32gb"] * 2 + ["t4"]
    assert [(d.node, d.local_rank) for d in devices] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    assert cluster.islands() == [[0, 1, 2, 3], [4, 5, 6]]
    assert [d.island for d in devices] == [0, 0, 0, 0, 1, 1, 1]
    assert cluster.kinds() == {"a100-sxm4-80gb": 4, "v100-sxm2-32gb": 2, "t4": 1}
    # node 0 is all NVLink; node 1 holds a T4 (no NVLink), so PCIe at the slowest device's rate.
    assert cluster.nodes[0].link == "nvlink" and cluster.nodes[1].link == "pcie"
    assert devices[0].intra_bytes_per_s == pytest.approx(300e9)
    assert devices[4].intra_bytes_per_s == pytest.approx(15.75e9)
    assert cluster.inter_node_bytes_per_s == pytest.approx(12.5e9)
    assert cluster.size == 7


def test_explicit_pcie_on_nvlink_devices(tmp_path: Path) -> None:
    text = "nodes:\n  - name: n\n    intra_link: pcie\n    devices:\n      - model: a100\n        count: 2\n"
    cluster = load_cluster(_write(tmp_path, text))
    assert {d.intra_bytes_per_s for d in cluster.devices()} == {get_gpu("a100").pcie_bytes_per_s}


def test_geforce_nodes_talk_through_host_memory_unless_the_file_says_pcie(tmp_path: Path) -> None:
    """GeForce parts have no peer-to-peer access over PCIe with the stock driver: their node's link
    is host-staged, at half of PCIe (every byte crosses it twice). One such device makes the whole
    node host-staged; a node whose driver allows peer access says intra_link: pcie."""
    assert not get_gpu("rtx-4090").pcie_p2p and not get_gpu("rtx-3090").pcie_p2p
    assert get_gpu("rtx-a6000").pcie_p2p and get_gpu("a100-pcie-80gb").pcie_p2p and get_gpu("l4").pcie_p2p

    def node(devices: str, link: str = "") -> Cluster:
        return load_cluster(_write(tmp_path, f"nodes:\n  - name: n\n{link}    devices:\n{devices}"))

    geforce = node("      - {model: rtx-4090, count: 2}\n")
    assert geforce.nodes[0].link == "host"
    assert [(d.intra_bytes_per_s, d.host_staged) for d in geforce.devices()] == [(0.5 * 31.5e9, True)] * 2
    mixed = node("      - model: rtx-a6000\n      - model: rtx-3090\n")
    assert mixed.nodes[0].link == "host" and all(d.host_staged for d in mixed.devices())
    pro = node("      - {model: rtx-a6000, count: 2}\n")
    assert pro.nodes[0].link == "pcie" and not any(d.host_staged for d in pro.devices())
    declared = node("      - {model: rtx-4090, count: 2}\n", "    intra_link: pcie\n")
    assert [(d.intra_bytes_per_s, d.host_staged) for d in declared.devices()] == [(31.5e9, False)] * 2


def test_yaml_round_trip(tmp_path: Path) -> None:
    cluster = load_cluster(_write(tmp_path, LAB))
    out = tmp_path / "out.yaml"
    save_cluster(cluster, out)
    again = load_cluster(out)
    assert again == cluster
    assert again.nodes[0].devices[0].model == "a100-sxm4-80gb"  # the alias is stored as the catalog name
    assert dump_cluster(again) == out.read_text()


def test_preset_round_trip(tmp_path: Path) -> None:
    cluster = get_preset("a100x4+v100x4")
    save_cluster(cluster, tmp_path / "p.yaml")
    assert load_cluster(tmp_path / "p.yaml") == cluster


def _error(tmp_path: Path, text: str) -> str:
    path = _write(tmp_path, text, "bad.yaml")
    with pytest.raises(HetrainError) as info:
        load_cluster(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg
    assert "fix" in msg or "see `hetrain devices --catalog`" in msg, msg
    return msg


def test_unknown_model_names_closest(tmp_path: Path) -> None:
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices:\n      - model: a100\n      - model: a1000\n")
    assert f"{tmp_path / 'bad.yaml'}:5: nodes[0].devices[1].model: unknown GPU model 'a1000'" in msg
    assert "closest catalog names: a100, a10" in msg


def test_count_below_one(tmp_path: Path) -> None:
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices:\n      - model: a100\n        count: 0\n")
    assert ":5: nodes[0].devices[0].count: count must be at least 1, got 0" in msg


def test_no_devices(tmp_path: Path) -> None:
    assert "the cluster has no devices" in _error(tmp_path, "nodes: []\n")
    assert "nodes[0].devices: devices is empty" in _error(tmp_path, "nodes:\n  - name: n\n    devices: []\n")
    assert "the file is empty" in _error(tmp_path, "")
    assert "missing key 'nodes'" in _error(tmp_path, "name: x\n")


def test_unknown_keys(tmp_path: Path) -> None:
    msg = _error(tmp_path, "nodes:\n  - name: n\n    gpus: 8\n    devices:\n      - model: a100\n")
    assert ":3: nodes[0].gpus: unknown key 'gpus'; fix: remove it or use one of: name, devices, intra_link" in msg
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices:\n      - model: a100\n        cnt: 2\n")
    assert "nodes[0].devices[0].cnt: unknown key 'cnt'; fix: remove it or use one of: model, count" in msg
    msg = _error(tmp_path, "bandwidth: 3\nnodes:\n  - name: n\n    devices:\n      - model: a100\n")
    assert ":1: bandwidth: unknown key 'bandwidth'; fix: remove it or use one of: name, nodes, inter_node_gbps" in msg


def test_a_required_key_written_wrong_is_named_by_its_spelling(tmp_path: Path) -> None:
    msg = _error(tmp_path, "nodes:\n  - name: n\n    gpus:\n      - model: a100\n")
    assert ":3: nodes[0].gpus: unknown key 'gpus', and 'devices' is missing; fix: rename it to 'devices'" in msg
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices:\n      - modle: a100\n        count: 2\n")
    assert ":4: nodes[0].devices[0].modle: unknown key 'modle', and 'model' is missing; fix: rename it to 'model'" in msg
    assert "missing key 'model'; fix: add it" in _error(tmp_path, "nodes:\n  - name: n\n    devices:\n      - count: 2\n")


def test_malformed_yaml(tmp_path: Path) -> None:
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices: [model: a100\n")
    assert "malformed YAML" in msg and f"{tmp_path / 'bad.yaml'}:4:" in msg
    assert "expected a mapping" in _error(tmp_path, "- a100\n- v100\n")


def test_values_yaml_reads_otherwise_than_meant_name_the_reading_and_the_fix(tmp_path: Path) -> None:
    """`inter_node_gbps: 1e2` was told to be 'a finite number' (YAML 1.1 reads it as text); `model: 3090` and
    `name: on` were told 'fix: correct the value'; `devices: [a100]` named an internal class, tabs went unnamed."""
    group = "nodes:\n  - name: n\n    devices:\n      - model: a100\n"
    assert ("inter_node_gbps must be a finite number, got '1e2', which YAML reads as text; fix: write it with a dot "
            "and a signed exponent (1.0e+2) or in full (100)") in _error(tmp_path, "inter_node_gbps: 1e2\n" + group)
    assert "model must be text, got 3090: YAML reads it as a number; fix: quote it" in _error(
        tmp_path, "nodes:\n  - name: n\n    devices:\n      - model: 3090\n")
    assert "name must be text, got True: YAML reads it as true or false (as it reads on, off" in _error(
        tmp_path, "name: on\n" + group)
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices: [a100]\n")
    assert "a device group must be a mapping such as {model: a100, count: 4}, got 'a100'" in msg
    assert "devicegroup" not in msg.lower(), msg
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices:\n\t- model: a100\n")
    assert msg.endswith("malformed YAML: a tab in the indentation; fix: indent with spaces"), msg
    assert "which YAML reads as text" not in _error(tmp_path, "inter_node_gbps: inf\n" + group)   # no finite number
    msg = _error(tmp_path, "nodes:\n  - name: n\t@x: [\n")   # a tab after the indentation
    assert "malformed YAML" in msg and "a tab in the indentation" not in msg, msg


def test_a_device_named_as_torch_names_it_is_told_the_catalog_name(tmp_path: Path) -> None:
    """'NVIDIA A100 80GB PCIe' (nvidia-smi's name) was offered 'a100-80gb', the SXM4 card, with NVLink."""
    msg = _error(tmp_path, "nodes:\n  - name: n\n    devices:\n      - model: NVIDIA A100 80GB PCIe\n")
    assert "unknown GPU model 'NVIDIA A100 80GB PCIe'; fix: write 'a100-pcie-80gb'" in msg, msg
    assert "fix: write 'h100-pcie-80gb'" in _error(tmp_path, "nodes:\n  - name: n\n    devices:\n"
                                                             "      - model: NVIDIA H100 PCIe\n")
    # a name that does not say its memory size: the sizes it may be, not one of them picked
    assert "one of a100-pcie-40gb, a100-pcie-80gb" in _error(tmp_path, "nodes:\n  - name: n\n    devices:\n"
                                                                      "      - model: NVIDIA A100 PCIe\n")


def test_bad_link_and_duplicates(tmp_path: Path) -> None:
    msg = _error(tmp_path, "nodes:\n  - name: n\n    intra_link: infiniband\n    devices:\n      - model: l4\n")
    assert "nodes[0].intra_link: intra_link must be 'nvlink', 'pcie' or 'host', got 'infiniband'" in msg
    msg = _error(tmp_path, "nodes:\n  - name: n\n    intra_link: nvlink\n    devices:\n      - model: l4\n")
    assert "the catalog lists no NVLink for l4" in msg
    msg = _error(tmp_path, "nodes:\n  - {name: n, devices: [{model: l4}]}\n  - {name: n, devices: [{model: t4}]}\n")
    assert "bad.yaml:3: top level: node name 'n' appears twice" in msg   # the line of the second one
    msg = _error(tmp_path, "inter_node_gbps: 0\nnodes:\n  - {name: n, devices: [{model: l4}]}\n")
    assert ":1: inter_node_gbps: inter_node_gbps must be more than 0" in msg


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(HetrainError, match="not found; fix: check the path"):
        load_cluster(tmp_path / "nope.yaml")


def test_cluster_from_devices() -> None:
    assert cluster_from_devices("a100:4").nodes[0].link == "nvlink"
    # NVLink joins boards of one model: an A100 and a V100 in one box talk over PCIe
    cluster = cluster_from_devices("a100:4,v100-sxm2-32gb:4")
    assert len(cluster.nodes) == 1 and cluster.nodes[0].link == "pcie"
    assert cluster.kinds() == {"a100-sxm4-80gb": 4, "v100-sxm2-32gb": 4}
    assert cluster.islands() == [list(range(8))]
    # A node that says nvlink for both keeps it; the V100's NVLink is the slower end and sets the rate.
    said = Cluster(name="c", nodes=[Node(name="n", intra_link="nvlink", devices=[
        {"model": "a100", "count": 4}, {"model": "v100-sxm2-32gb", "count": 4}])])
    assert {d.intra_bytes_per_s for d in said.devices()} == {150e9}
    assert cluster_from_devices("a100:2,l4").nodes[0].link == "pcie"
    assert cluster_from_devices("cpu:2").kinds() == {"cpu": 2}


@pytest.mark.parametrize(
    "arg, text",
    [("a100:x", "count 'x' of 'a100' is not a positive integer"), ("a100:0", "count '0'"),
     ("a1000:2", "unknown GPU model 'a1000'"), ("", "names no device")],
)
def test_cluster_from_devices_errors(arg: str, text: str) -> None:
    with pytest.raises(HetrainError, match=text):
        cluster_from_devices(arg)


def test_presets() -> None:
    sizes = {name: get_preset(name).size for name in PRESETS}
    assert sizes == {"a100x8": 8, "v100x8": 8, "a100x4+v100x4": 8, "mix1024": 1024}
    assert get_preset("a100x8").kinds() == {"a100-sxm4-80gb": 8}
    assert get_preset("v100x8").kinds() == {"v100-sxm2-32gb": 8}
    two = get_preset("a100x4+v100x4")
    assert two.islands() == [[0, 1, 2, 3], [4, 5, 6, 7]] and two.inter_node_gbps == 100
    assert all(node.link == "nvlink" for node in two.nodes)


def test_mix1024() -> None:
    cluster = get_preset("mix1024")
    devices = cluster.devices()
    assert len(devices) == 1024 and [d.rank for d in devices] == list(range(1024))
    assert len(cluster.kinds()) == 4 and sum(cluster.kinds().values()) == 1024
    islands = cluster.islands()
    assert len(islands) == 128 and all(len(i) == 8 for i in islands)
    assert sorted(r for i in islands for r in i) == list(range(1024))
    assert cluster.inter_node_gbps == 200
    assert {node.link for node in cluster.nodes} == {"nvlink", "pcie"}


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(HetrainError) as info:
        get_preset("a100x9")
    assert str(info.value) == f"unknown preset 'a100x9'; choose one of: {', '.join(PRESETS)}"


def test_python_construction_validates() -> None:
    with pytest.raises(ValidationError, match="unknown GPU model 'nope'"):
        Cluster(nodes=[{"name": "n", "devices": [{"model": "nope"}]}])


def test_yaml_aliases_are_read_but_cannot_expand_without_bound(tmp_path: Path) -> None:
    # an anchor reused for a second node is an ordinary way to write a cluster file
    f = tmp_path / "ok.yaml"
    f.write_text("nodes:\n  - name: a\n    devices: &gpus [{model: a100, count: 2}]\n  - name: b\n    devices: *gpus\n")
    assert load_cluster(f).size == 4
    # nine levels of nine aliases stand for 9**9 values in a few hundred bytes
    levels = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(levels) + "\nnodes: [*l8]\n")
    started = time.perf_counter()
    with pytest.raises(HetrainError, match=r"aliases \(\*name\) expand to more than 2,000,000 values; .*fix: write the nodes out"):
        load_cluster(f)
    assert time.perf_counter() - started < 10


def test_yaml_merge_keys_are_read_their_keys_overridden_by_those_beside_them(tmp_path: Path) -> None:
    """`- <<: *g` then `count: 3` was refused as malformed YAML: the merge key was built as a key of its own."""
    cluster = load_cluster(_write(tmp_path, "nodes:\n  - name: a\n    devices:\n      - &g {model: a100, count: 2}\n"
                                            "      - <<: *g\n        count: 3\n"))
    assert [(g.spec.name, g.count) for g in cluster.nodes[0].devices] == [("a100-sxm4-80gb", 2), ("a100-sxm4-80gb", 3)]
    with pytest.raises(HetrainError, match=r"key 'count' appears twice in one mapping"):   # twice beside it: refused
        load_cluster(_write(tmp_path, "nodes:\n  - name: a\n    devices:\n      - &g {model: a100, count: 2}\n"
                                      "      - {<<: *g, count: 3, count: 4}\n"))


def test_an_error_shows_a_short_part_of_a_large_value(tmp_path: Path) -> None:
    levels = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 4)]
    msg = _error(tmp_path, "\n".join(levels) + "\nnodes: [*l3]\n")
    assert "nodes[0]: a node must be a mapping such as {name: n1, devices: [...]}, got [[" in msg and len(msg) < 400
    msg = _error(tmp_path, f'nodes:\n  - name: n\n    devices:\n      - model: a100\n        count: "{"9" * 300}"\n')
    assert "count must be a whole number, got '999" in msg and len(msg) < 300


def test_the_docs_alias_list_names_every_alias_and_catalog_name() -> None:
    """docs/cluster-file.md left out the aliases a100-80gb and v100-32gb, which error messages suggest, and three
    PCIe catalog names."""
    import re

    from hetrain.hardware.catalog import ALIASES, load_catalog

    docs = (Path(__file__).resolve().parents[2] / "docs" / "cluster-file.md").read_text()
    section = docs.split("## Aliases", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", section))
    names = set(ALIASES) | set(load_catalog())
    assert names <= named, sorted(names - named)
    for alias, name in ALIASES.items():   # each alias is written beside the name it stands for
        assert re.search(rf"`{alias}`\s+=\s+(`[a-z0-9-]+`\s+=\s+)*{name}\b", section), alias

