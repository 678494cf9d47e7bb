"""`hetrain devices`: local devices, catalog, clusters, topology; one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetrain.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["devices", "--json", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    return json.loads(out)


def test_bad_cluster_file_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - name: n\n    devices:\n      - model: a1000\n        count: 2\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "hetrain.cli.main", "devices", "--cluster", str(bad)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"hetrain devices: error: {bad}:4: nodes[0].devices[0].model: unknown GPU model 'a1000'")
    assert "closest catalog names: a100, a10" in lines[0]


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--preset", "a100x9"], "hetrain devices: error: unknown preset 'a100x9'; choose one of: a100x8"),
        (["--cluster", "/nonexistent/c.yaml"], "not found; fix: check the path"),
        (["--devices", "a100:zero"], "is not a positive integer"),
        (["--topo", "/nonexistent/topo.txt"], "topology file '/nonexistent/topo.txt' not found"),
    ],
)
def test_errors_in_process(capsys: pytest.CaptureFixture[str], argv: list[str], text: str) -> None:
    assert main(["devices", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and text in captured.err and captured.err.count("\n") == 1


def test_local_json(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys)
    assert doc["local"] and {d["kind"] for d in doc["local"]} <= {"cpu", "cuda"}
    if doc["local"][0]["kind"] == "cpu":
        assert doc["local"][0]["catalog"] == "cpu" and doc["islands"] == [[0]]


def test_local_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "devices on this machine" in out and "catalog" in out


def test_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--catalog")
    by_name = {e["name"]: e for e in doc["catalog"]}
    assert by_name["a100-sxm4-80gb"]["peak_flops"]["bf16"] == 312e12
    assert by_name["a100-sxm4-80gb"]["aliases"] == ["a100", "a100-80gb"]
    assert by_name["v100-sxm2-32gb"]["bf16"] is False and by_name["cpu"]["estimate"] is True
    assert by_name["rtx-4090"]["pcie_p2p"] is False and by_name["rtx-a6000"]["pcie_p2p"] is True
    assert main(["devices", "--catalog"]) == 0
    table = capsys.readouterr().out
    assert "h200-sxm-141gb" in table and "989.4" in table  # h100 sxm fp16 TFLOP/s
    # GeForce parts are marked: no peer access, so a node of them talks through host memory
    assert "31.50 h" in next(line for line in table.splitlines() if "rtx-4090" in line)
    assert "h: no peer-to-peer access over PCIe" in table


def test_preset_json(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--preset", "mix1024")
    assert doc["size"] == 1024 and len(doc["devices"]) == 1024 and len(doc["kinds"]) == 4
    assert len(doc["islands"]) == 128 and doc["inter_node_gbps"] == 200
    assert doc["nodes"][0]["link"] == "nvlink" and doc["nodes"][-1]["link"] == "pcie"
    assert doc["devices"][1023] == {
        "rank": 1023, "node": 127, "local_rank": 7, "model": "l4", "island": 127, "intra_bytes_per_s": 31.5e9,
    }


def test_cluster_file_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text("name: lab\nnodes:\n  - name: a\n    devices: [{model: a100, count: 4}]\n"
                    "  - name: b\n    devices: [{model: l4, count: 2}]\n")
    assert main(["devices", "--cluster", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cluster lab: 6 devices (4x a100-sxm4-80gb, 2x l4) on 2 nodes" in out
    assert "nvlink 300 GB/s" in out and "pcie 31.5 GB/s" in out
    assert "islands: 2 (one per node): [0-3]  [4-5]" in out
    assert "network: 100 Gb/s per node (12.5 GB/s)" in out


def test_devices_flag(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--devices", "a100:4,v100-sxm2-32gb:4")
    assert doc["kinds"] == {"a100-sxm4-80gb": 4, "v100-sxm2-32gb": 4} and doc["islands"] == [list(range(8))]


def test_topo_file(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--topo", str(FIXTURES / "topo_two_nvlink_pairs.txt"))
    assert doc["islands"] == [[0, 1], [2, 3]] and doc["topo"]["links"][0] == ["X", "NV4", "SYS", "SYS"]


def test_one_source_at_a_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["devices", "--catalog", "--preset", "a100x8"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
