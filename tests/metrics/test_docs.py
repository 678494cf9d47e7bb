"""docs/observe.md names every series, and its PodMonitor scrapes the ports `hetrain k8s` opens."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from hetrain.launch.k8s import K8sJob, manifests
from hetrain.metrics.names import METRICS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "observe.md").read_text()


def _yaml_blocks() -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC, re.S)]


def test_every_series_is_documented():
    missing = [m.name for m in METRICS if f"`{m.name}" not in DOC]
    assert not missing, missing


def test_pod_monitor_selects_the_manifest_s_pods_and_metrics_ports():
    [monitor] = [b for b in _yaml_blocks() if b.get("kind") == "PodMonitor"]
    job = K8sJob(image="img", script="train.py", name="hetrain", gpus_per_node=2, metrics_port=9400)
    [pj] = [d for d in manifests(job) if d["kind"] == "PyTorchJob"]
    template = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    ports = {p["name"] for p in template["spec"]["containers"][0]["ports"] if p["name"].startswith("metrics-")}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in endpoints} == ports == {"metrics-0", "metrics-1"}
    assert all(e["honorLabels"] for e in endpoints)   # keep the ranks' own `job` label


def test_static_scrape_config_keeps_the_ranks_job_label():
    [config] = [b for b in _yaml_blocks() if "scrape_configs" in b]
    assert config["scrape_configs"][0]["honor_labels"] is True
