"""`hetrain k8s` from the command line: a manifest file, or one error line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hetrain.cli.main import main
from hetrain.planning.plan import Plan
from tests.k8s.openapi_subset import validate

SCHEMA = yaml.safe_load((Path(__file__).parent / "fixtures" / "pytorchjob_crd_subset.yaml").read_text())


def test_writes_a_valid_manifest_with_plan(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    even = Plan.even(16, 512)
    even.model_copy(update={"ranks": [r.model_copy(update={"device": "a100-sxm4-80gb" if r.rank < 8 else
                                                           "v100-sxm2-32gb"}) for r in even.ranks]}).save(plan)
    out = tmp_path / "job.yaml"
    rc = main(["k8s", "--image", "reg/train:1", "--script", "train.py", "--min-replicas", "1", "--max-replicas", "2",
               "--max-restarts", "3", "--gpus-per-node", "8", "--plan", str(plan),
               "--node-selector", "A100=nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB",
               "--node-selector", "V100=nvidia.com/gpu.product=Tesla-V100-SXM2-32GB",
               "--checkpoint-pvc", "shared-ckpts", "--out", str(out), "--", "--lr", "0.1"])
    assert rc == 0
    config_map, pj = yaml.safe_load_all(out.read_text())
    assert validate(pj, SCHEMA) == []
    assert Plan.from_json(config_map["data"]["plan.json"]).global_batch_size == 512
    cmd = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[-3:] == ["train.py", "--lr", "0.1"] and "--checkpoint-dir" in cmd


@pytest.mark.parametrize("argv, message", [
    (["--image", "x", "--script", "t.py", "--min-replicas", "3", "--max-replicas", "2"],
     "--min-replicas 3 > --max-replicas 2"),
    (["--image", "x"], "no training script"),
    (["--image", "x", "--script", "t.py", "--node-selector", "A100"], "must be KIND=LABEL_KEY=LABEL_VALUE"),
    (["--image", "x", "--script", "t.py", "--plan", "missing.json"], "plan file 'missing.json' does not exist"),
    # manifests that hetrain launch, or Kubernetes, refuses were written (found auditing the CLI)
    (["--image", "x", "--script", "t.py", "--gpus-per-node", "2000"], "--gpus-per-node must be from 1 to 1,024"),
    (["--image", "x", "--script", "t.py", "--namespace", "Team A"], "is not a Kubernetes namespace"),
    (["--image", "x", "--script", "t.py", "--checkpoint-dir", "ckpt"], "give one starting with /"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["k8s", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("hetrain k8s: error:") and message in err


def test_a_node_selector_for_a_kind_the_plan_lacks_is_refused_and_another_size_is_said(tmp_path, capsys):
    """Every rank on an H100 pod would stop with 'no entry for h100' at every restart: the manifest was
    written without a word, as it was for a plan of 3 ranks on 2 to 4 pods of 8."""
    from hetrain.planning.plan import RankPlan

    plan = tmp_path / "plan.json"
    Plan(global_batch_size=64, ranks=[RankPlan(rank=0, device="a100-sxm4-80gb", share=32),
                                      RankPlan(rank=1, device="v100-sxm2-32gb", share=16),
                                      RankPlan(rank=2, device="v100-sxm2-32gb", share=16)]).save(plan)
    common = ["k8s", "--image", "x", "--script", "t.py", "--min-replicas", "2", "--max-replicas", "4",
              "--gpus-per-node", "8", "--plan", str(plan), "--checkpoint-pvc", "ck", "--out", str(tmp_path / "j.yaml")]
    assert main([*common, "--node-selector", "h100=nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"]) == 2
    err = capsys.readouterr().err
    assert "the plan has no entry for h100 (h100-sxm5-80gb in the catalog; the plan's devices: a100-sxm4-80gb, " \
        "v100-sxm2-32gb)" in err and "write one of the plan's device names as KIND" in err, err
    assert main([*common, "--node-selector", "a100=k=a", "--node-selector", "v100=k=v"]) == 0
    err = capsys.readouterr().err
    assert "the plan has 3 ranks and the job runs 16 to 32 (8 per pod)" in err, err
    assert "gpu-kinds: a100-sxm4-80gb,v100-sxm2-32gb" in (tmp_path / "j.yaml").read_text()
    assert "has no --node-selector" not in err
    # a selector for one of the plan's two kinds: every pod on A100 nodes, the V100 entries never used
    assert main([*common, "--node-selector", "a100=k=a"]) == 0
    err = capsys.readouterr().err
    assert "note: the plan's v100-sxm2-32gb has no --node-selector: the selectors admit a100-sxm4-80gb only" in err \
        and "add --node-selector v100-sxm2-32gb=KEY=VALUE" in err, err
    # a short name is the plan's device it names: A100 for a plan of A100 PCIe 40 GB cards
    pcie = tmp_path / "pcie.json"
    Plan(global_batch_size=8, ranks=[RankPlan(rank=0, device="a100-pcie-40gb", share=8)]).save(pcie)
    assert main(["k8s", "--image", "x", "--script", "t.py", "--gpus-per-node", "1", "--plan", str(pcie),
                 "--node-selector", "A100=nvidia.com/gpu.product=NVIDIA-A100-PCIE-40GB",
                 "--out", str(tmp_path / "p.yaml")]) == 0, capsys.readouterr().err
    assert "gpu-kinds: a100-pcie-40gb" in (tmp_path / "p.yaml").read_text()
