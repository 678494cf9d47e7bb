"""`hetrain k8s` manifests against the training operator's PyTorchJob schema."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from hetrain.errors import HetrainError
from hetrain.launch.k8s import K8sJob, NodeSelector, launch_command, manifests, parse_node_selector, to_yaml
from tests.k8s.openapi_subset import validate

SCHEMA = yaml.safe_load((Path(__file__).parent / "fixtures" / "pytorchjob_crd_subset.yaml").read_text())
A100 = NodeSelector("A100", "nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB")
V100 = NodeSelector("V100", "nvidia.com/gpu.product", "Tesla-V100-SXM2-32GB")
L4 = NodeSelector("L4", "cloud.google.com/gke-accelerator", "nvidia-l4")


def _job(**kw) -> K8sJob:
    base = dict(image="registry.example/team/train:1.0", script="train.py", script_args=["--epochs", "3"],
                name="mixed-run", min_replicas=2, max_replicas=4, max_restarts=5, gpus_per_node=8)
    return K8sJob(**{**base, **kw})


def _pytorchjob(job: K8sJob) -> dict:
    docs = list(yaml.safe_load_all(to_yaml(manifests(job))))
    (pj,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    return pj


@pytest.mark.parametrize("selectors", [[], [A100], [A100, V100], [A100, V100, L4]])
@pytest.mark.parametrize("extras", [{}, {"plan_json": "{}", "checkpoint_pvc": "ckpts", "namespace": "ml"}])
def test_manifest_matches_the_operator_schema(selectors, extras):
    pj = _pytorchjob(_job(node_selectors=selectors, **extras))
    assert validate(pj, SCHEMA) == []
    assert pj["apiVersion"] == "kubeflow.org/v1" and pj["kind"] == "PyTorchJob"


def test_elastic_policy_and_worker_spec():
    pj = _pytorchjob(_job(node_selectors=[A100]))
    assert pj["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 4,
                                           "maxRestarts": 5, "nProcPerNode": 8}
    assert list(pj["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    worker = pj["spec"]["pytorchReplicaSpecs"]["Worker"]
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert "affinity" not in pod


def test_container_runs_hetrain_launch_with_the_elastic_flags():
    from hetrain.cli import launch as launch_cli

    job = _job(plan_json="{}", checkpoint_pvc="ckpts")
    cmd = _pytorchjob(job)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["hetrain", "launch"] and cmd == launch_command(job)
    parser = argparse.ArgumentParser()
    launch_cli.build_parser(parser)
    args = parser.parse_args(cmd[2:])  # the command is one `hetrain launch` accepts
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("2:4", 8, 5)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "mixed-run-worker-0:23456", "mixed-run")
    assert args.plan == "/etc/hetrain/plan.json" and args.checkpoint_dir == "/checkpoints"
    assert args.script == "train.py" and args.script_args == ["--epochs", "3"]


def _checkpoints(job: K8sJob) -> tuple[list[str], list, list]:
    """(container command, checkpoint volumes, their mounts) of a job's manifest."""
    pod = _pytorchjob(job)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    return (container["command"], [v for v in pod["volumes"] if v["name"] == "checkpoints"],
            [m for m in container["volumeMounts"] if m["name"] == "checkpoints"])


def test_checkpoints_go_to_the_claim_else_a_one_pod_jobs_own_directory_else_nowhere():
    from hetrain.launch.k8s import checkpoint_note

    cmd, volumes, mounts = _checkpoints(_job(checkpoint_pvc="ckpts"))
    assert cmd[cmd.index("--checkpoint-dir") + 1] == "/checkpoints" and mounts[0]["mountPath"] == "/checkpoints"
    assert volumes == [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpts"}}]
    one_pod = _job(min_replicas=1, max_replicas=1, checkpoint_dir="/ckpt")
    cmd, volumes, mounts = _checkpoints(one_pod)   # restarts inside the pod resume
    assert cmd[cmd.index("--checkpoint-dir") + 1] == "/ckpt" and mounts[0]["mountPath"] == "/ckpt"
    assert volumes == [{"name": "checkpoints", "emptyDir": {}}]
    assert "restarts inside the pod resume" in checkpoint_note(one_pod)
    cmd, volumes, mounts = _checkpoints(_job())     # 2-4 pods and no claim: no directory they all share
    assert "--checkpoint-dir" not in cmd and volumes == [] and mounts == []
    assert "keeps no checkpoints" in checkpoint_note(_job()) and "--checkpoint-pvc CLAIM" in checkpoint_note(_job())
    assert checkpoint_note(_job(checkpoint_pvc="ckpts")) is None


def test_several_kinds_become_one_affinity_admitting_each():
    pod = _pytorchjob(_job(node_selectors=[A100, V100, L4]))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # terms are ORed by the scheduler: one per label key, listing every allowed value
    assert terms == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                               "values": ["NVIDIA-A100-SXM4-80GB", "Tesla-V100-SXM2-32GB"]}]},
        {"matchExpressions": [{"key": "cloud.google.com/gke-accelerator", "operator": "In", "values": ["nvidia-l4"]}]},
    ]
    assert "nodeSelector" not in pod


def test_plan_ships_in_a_configmap_mounted_where_launch_reads_it():
    docs = manifests(_job(plan_json='{"version": 1}'))
    config_map, pj = docs
    assert config_map["kind"] == "ConfigMap" and config_map["data"] == {"plan.json": '{"version": 1}'}
    pod = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert {"name": "plan", "configMap": {"name": config_map["metadata"]["name"]}} in pod["volumes"]
    assert {"name": "plan", "mountPath": "/etc/hetrain", "readOnly": True} in pod["containers"][0]["volumeMounts"]


def test_the_validator_catches_what_the_api_server_would_reject_or_drop():
    pj = _pytorchjob(_job())
    bad = yaml.safe_load(yaml.safe_dump(pj))
    bad["spec"]["elasticPolicy"]["minReplicas"] = "2"
    bad["spec"]["elasticPolicy"]["maxReplicas"] = 2**31
    bad["spec"]["elasticPolicy"]["rdzvBackendd"] = "c10d"
    del bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"]
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] = "eight"
    errors = "\n".join(validate(bad, SCHEMA))
    assert "spec.elasticPolicy.minReplicas: expected integer" in errors
    assert "spec.elasticPolicy.maxReplicas: 2147483648 is outside int32" in errors
    assert "spec.elasticPolicy.rdzvBackendd: unknown field" in errors
    assert "containers[0]: missing required field 'name'" in errors
    assert "nvidia.com/gpu: 'eight' does not match" in errors
    del bad["spec"]["pytorchReplicaSpecs"]
    assert "spec: missing required field 'pytorchReplicaSpecs'" in validate(bad, SCHEMA)
    assert validate("x", {"type": "string", "enum": ["c10d"]}) == ["<root>: 'x' is not one of ['c10d']"]


@pytest.mark.parametrize("kw, message", [
    ({"min_replicas": 3, "max_replicas": 2}, "--min-replicas 3 > --max-replicas 2"),
    ({"script": ""}, "no training script"),
    ({"image": ""}, "no container image"),
    ({"min_replicas": 0}, "--min-replicas must be >= 1"),
    ({"gpus_per_node": 0}, "--gpus-per-node must be from 1 to 1,024, got 0"),
    ({"name": "Mixed_Run"}, "--name 'Mixed_Run'"),
    ({"node_selectors": [A100, A100]}, "repeat"),
])
def test_bad_jobs_are_refused_with_the_fix(kw, message):
    with pytest.raises(HetrainError, match=message):
        manifests(_job(**kw))


def test_parse_node_selector():
    assert parse_node_selector("A100=nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB") == A100
    with pytest.raises(HetrainError, match="--node-selector 'foo=a=b': unknown GPU model 'foo'; closest catalog"):
        parse_node_selector("foo=a=b")
    for bad in ("A100", "A100=nvidia.com/gpu.product", "A100=bad key=x", "A100=k=has space"):
        with pytest.raises(HetrainError, match="--node-selector"):
            parse_node_selector(bad)


def test_metrics_ports_one_per_local_rank_and_the_launch_flag():
    job = _job(gpus_per_node=2, metrics_port=9400)
    pj = _pytorchjob(job)
    assert validate(pj, SCHEMA) == []
    (container,) = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    metrics = [p for p in container["ports"] if p["name"].startswith("metrics-")]
    assert metrics == [{"name": "metrics-0", "containerPort": 9400, "protocol": "TCP"},
                       {"name": "metrics-1", "containerPort": 9401, "protocol": "TCP"}]
    i = container["command"].index("--metrics-port")
    assert container["command"][i + 1] == "9400"
    with pytest.raises(HetrainError, match="rendezvous port 23456"):
        manifests(_job(gpus_per_node=2, metrics_port=23455))
    with pytest.raises(HetrainError, match="--metrics-port 65535"):
        manifests(_job(gpus_per_node=2, metrics_port=65535))
