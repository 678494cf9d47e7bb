"""An elastic Kubeflow PyTorchJob that runs `hetrain launch` on every pod.

The training operator runs one Worker replica spec; each pod runs torch's elastic agent through
`hetrain launch --nnodes MIN:MAX`, which meets the others at a c10d rendezvous on the first
worker pod and restarts the workers (up to --max-restarts) when one dies. GPU kinds are chosen
per pod by node labels: one kind is a nodeSelector, several kinds a node affinity that admits any
of them (a PyTorchJob has one Worker spec, so one job spans the kinds by admitting them all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from hetrain.errors import HetrainError
from hetrain.launch.launcher import MAX_NPROC_PER_NODE
from hetrain.metrics.serve import check_port_range

API_VERSION = "kubeflow.org/v1"
RDZV_PORT = 23456  # the operator's default port name `pytorchjob-port`
PLAN_MOUNT = "/etc/hetrain"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class NodeSelector:
    """Pods of GPU kind `kind` run on nodes labelled `key=value`."""

    kind: str
    key: str
    value: str


def parse_node_selector(text: str) -> NodeSelector:
    """`A100=nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB` -> NodeSelector(kind, key, value)."""
    parts = text.split("=", 2)
    if len(parts) != 3 or not all(parts):
        raise HetrainError(
            f"--node-selector {text!r} must be KIND=LABEL_KEY=LABEL_VALUE, "
            f"e.g. A100=nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB"
        )
    kind, key, value = parts
    from hetrain.hardware.catalog import get_gpu

    try:
        get_gpu(kind)   # a kind the catalog does not know is a typo: said here, not at every pod's start
    except HetrainError as e:
        raise HetrainError(f"--node-selector {text!r}: {e}") from None
    if not _LABEL_KEY.match(key) or len(key.split("/")[-1]) > 63:
        raise HetrainError(f"--node-selector {text!r}: {key!r} is not a Kubernetes label key; use e.g. nvidia.com/gpu.product")
    if not _LABEL_VALUE.match(value) or len(value) > 63:
        raise HetrainError(
            f"--node-selector {text!r}: {value!r} is not a Kubernetes label value (up to 63 letters, digits, '-', '_', '.')"
        )
    return NodeSelector(kind, key, value)


def catalog_kinds(selectors: list[NodeSelector], plan: Any = None) -> list[NodeSelector]:
    """The selectors with their kinds as the catalog names them (as the plan's entries and the ranks' devices
    are written). With a plan, a short name (A100) is the plan's device it names (a100-pcie-40gb), and a
    kind the plan has no entry for is refused: every rank on such a pod would stop at each restart."""
    from hetrain.hardware.catalog import get_gpu

    kinds = sorted({e.device for e in plan.ranks}) if plan is not None else []
    out = []
    for s in selectors:
        name = get_gpu(s.kind).name
        if plan is not None and name not in kinds:
            named = [k for k in kinds if k.startswith(s.kind.lower())]
            if len(named) != 1:
                raise HetrainError(
                    f"--node-selector {s.kind}={s.key}={s.value}: the plan has no entry for {s.kind} ({name} in the "
                    f"catalog; the plan's devices: {', '.join(kinds)}); every rank on such a pod would stop; write "
                    "one of the plan's device names as KIND, re-plan for the kinds the job runs on, or leave out "
                    "that selector")
            name = named[0]
        out.append(NodeSelector(name, s.key, s.value))
    return out


def unselected_kinds_note(plan: Any, selectors: list[NodeSelector]) -> str | None:
    """Selectors that admit some of the plan's device kinds only (as `catalog_kinds` names them): pods never land
    on the others, so their entries go unused. Said, not refused: a job may leave a kind out on purpose."""
    if plan is None or not selectors:
        return None
    left = sorted({e.device for e in plan.ranks} - {s.kind for s in selectors})
    if not left:
        return None
    return (f"note: the plan's {', '.join(left)} has no --node-selector: the selectors admit "
            f"{', '.join(sorted({s.kind for s in selectors}))} only, so no pod lands on such a node and the ranks "
            f"re-split the shares without it; add --node-selector {left[0]}=KEY=VALUE to run on it")


def plan_notes(plan: Any, min_replicas: int, max_replicas: int, gpus_per_node: int) -> list[str]:
    """A plan for another number of ranks than the job may have is said, not refused (the ranks re-split
    its shares for the devices present)."""
    lo, hi = min_replicas * gpus_per_node, max_replicas * gpus_per_node
    if not lo <= plan.world_size <= hi:
        span = f"{lo}" if lo == hi else f"{lo} to {hi}"
        return [f"the plan has {plan.world_size} ranks and the job runs {span} ({gpus_per_node} per pod): the ranks "
                "re-split its shares for the devices present; re-plan for the job's devices to run the plan as made"]
    return []


@dataclass
class K8sJob:
    """What `hetrain k8s` was asked for."""

    image: str
    script: str
    script_args: list[str] = field(default_factory=list)
    name: str = "hetrain"
    namespace: str | None = None
    min_replicas: int = 1
    max_replicas: int = 1
    max_restarts: int = 3
    gpus_per_node: int = 1
    node_selectors: list[NodeSelector] = field(default_factory=list)
    plan_json: str | None = None
    checkpoint_pvc: str | None = None
    checkpoint_dir: str = "/checkpoints"
    metrics_port: int | None = None
    """base port of `hetrain launch --metrics-port`: container ports metrics-0.. (one per local rank)"""


def validate(job: K8sJob) -> None:
    """User errors, each one line naming the fix."""
    if not job.script:
        raise HetrainError("no training script; pass --script train.py (the path inside the image)")
    if not job.image:
        raise HetrainError("no container image; pass --image REGISTRY/IMAGE:TAG holding hetrain and the script")
    if not _NAME.match(job.name) or len(job.name) > 45:
        raise HetrainError(
            f"--name {job.name!r} must be lowercase letters, digits and '-' (at most 45, pods add '-worker-N')"
        )
    if job.min_replicas < 1:
        raise HetrainError(f"--min-replicas must be >= 1, got {job.min_replicas}")
    if job.min_replicas > job.max_replicas:
        raise HetrainError(
            f"--min-replicas {job.min_replicas} > --max-replicas {job.max_replicas}; "
            f"the job needs MIN <= MAX nodes (e.g. --min-replicas {job.max_replicas} --max-replicas {job.min_replicas})"
        )
    if job.max_restarts < 0:
        raise HetrainError(f"--max-restarts must be >= 0, got {job.max_restarts}")
    if not 1 <= job.gpus_per_node <= MAX_NPROC_PER_NODE:   # each a rank of `hetrain launch --nproc-per-node`
        raise HetrainError(f"--gpus-per-node must be from 1 to {MAX_NPROC_PER_NODE:,}, got {job.gpus_per_node:,}")
    if job.namespace is not None and (not _NAME.match(job.namespace) or len(job.namespace) > 63):
        raise HetrainError(f"--namespace {job.namespace!r} is not a Kubernetes namespace: lowercase letters, digits "
                           "and '-', at most 63")
    if not job.checkpoint_dir.startswith("/"):
        raise HetrainError(f"--checkpoint-dir {job.checkpoint_dir!r} is a path inside the pod and Kubernetes mounts "
                           "only absolute ones: give one starting with /, e.g. /checkpoints")
    if job.metrics_port is not None:
        check_port_range(job.metrics_port, job.gpus_per_node)
        if job.metrics_port <= RDZV_PORT < job.metrics_port + job.gpus_per_node:
            raise HetrainError(f"--metrics-port {job.metrics_port}: ports {job.metrics_port}.."
                               f"{job.metrics_port + job.gpus_per_node - 1} include the rendezvous port {RDZV_PORT}; "
                               f"choose another, e.g. --metrics-port 9400")
    kinds = [s.kind for s in job.node_selectors]
    if len(set(kinds)) != len(kinds):
        raise HetrainError(f"GPU kinds {kinds} repeat in --node-selector; give each kind once")


def launch_command(job: K8sJob) -> list[str]:
    """The container's command: `hetrain launch` with the elastic flags and the rendezvous on worker 0."""
    cmd = [
        "hetrain", "launch",
        "--nnodes", f"{job.min_replicas}:{job.max_replicas}",
        "--nproc-per-node", str(job.gpus_per_node),
        "--max-restarts", str(job.max_restarts),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{job.name}-worker-0:{RDZV_PORT}",
        "--rdzv-id", job.name,
    ]
    if job.plan_json is not None:
        cmd += ["--plan", f"{PLAN_MOUNT}/plan.json"]
    if checkpoint_volume(job) is not None:
        cmd += ["--checkpoint-dir", job.checkpoint_dir]
    if job.metrics_port is not None:
        cmd += ["--metrics-port", str(job.metrics_port)]
    return cmd + [job.script, *job.script_args]


def checkpoint_volume(job: K8sJob) -> dict[str, Any] | None:
    """Where the checkpoints live: the shared claim; without one, for a job of one pod, a directory of
    the pod's own that outlives restarts of its processes and container; for several pods none, as
    every rank must write into, and resume from, one directory."""
    if job.checkpoint_pvc is not None:
        return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": job.checkpoint_pvc}}
    if job.max_replicas == 1:
        return {"name": "checkpoints", "emptyDir": {}}
    return None


def checkpoint_note(job: K8sJob) -> str | None:
    """What a user without --checkpoint-pvc should know."""
    if job.checkpoint_pvc is not None:
        return None
    if job.max_replicas == 1:
        return (f"note: no --checkpoint-pvc: checkpoints go to the pod's own {job.checkpoint_dir} (emptyDir): "
                "restarts inside the pod resume, a rescheduled pod starts from step 0")
    return (f"note: no --checkpoint-pvc: the job's up to {job.max_replicas} pods share no directory, so it keeps no "
            "checkpoints and a restart starts from step 0; pass --checkpoint-pvc CLAIM (ReadWriteMany)")


def metrics_ports(job: K8sJob) -> list[dict[str, Any]]:
    """Container ports `metrics-0`.. of the local ranks' /metrics endpoints (a PodMonitor selects them by name)."""
    if job.metrics_port is None:
        return []
    return [{"name": f"metrics-{i}", "containerPort": job.metrics_port + i, "protocol": "TCP"}
            for i in range(job.gpus_per_node)]


def _scheduling(selectors: list[NodeSelector]) -> dict[str, Any]:
    if not selectors:
        return {}
    if len(selectors) == 1:
        return {"nodeSelector": {selectors[0].key: selectors[0].value}}
    by_key: dict[str, list[str]] = {}
    for s in selectors:
        by_key.setdefault(s.key, []).append(s.value)
    # terms are ORed: a node of any listed kind admits a worker pod
    terms = [{"matchExpressions": [{"key": key, "operator": "In", "values": values}]} for key, values in by_key.items()]
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}


def _metadata(job: K8sJob, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "hetrain"}}
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def manifests(job: K8sJob) -> list[dict[str, Any]]:
    """The documents to apply: a ConfigMap with the plan (when given), then the PyTorchJob."""
    validate(job)
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    docs: list[dict[str, Any]] = []
    if job.plan_json is not None:
        plan_map = f"{job.name}-plan"
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(job, plan_map),
                     "data": {"plan.json": job.plan_json}})
        volumes.append({"name": "plan", "configMap": {"name": plan_map}})
        mounts.append({"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True})
    volume = checkpoint_volume(job)
    if volume is not None:
        volumes.append(volume)
        mounts.append({"name": "checkpoints", "mountPath": job.checkpoint_dir})
    container = {
        "name": "pytorch",  # the operator looks for this container name
        "image": job.image,
        "imagePullPolicy": "IfNotPresent",
        "command": launch_command(job),
        "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT, "protocol": "TCP"}, *metrics_ports(job)],
        "resources": {"limits": {"nvidia.com/gpu": job.gpus_per_node}},
        "volumeMounts": mounts,
    }
    pod_spec = {**_scheduling(job.node_selectors), "containers": [container], "volumes": volumes}
    kinds = ",".join(s.kind for s in job.node_selectors)
    template_meta = {"labels": {"app.kubernetes.io/name": job.name}}
    if kinds:
        template_meta["annotations"] = {"hetrain.dev/gpu-kinds": kinds}
    docs.append({
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": _metadata(job, job.name),
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": job.min_replicas,
                "maxReplicas": job.max_replicas,
                "maxRestarts": job.max_restarts,
                "nProcPerNode": job.gpus_per_node,
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": job.max_replicas,
                    "restartPolicy": "OnFailure",
                    "template": {"metadata": template_meta, "spec": pod_spec},
                },
            },
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": max(job.max_restarts, 1)},
        },
    })
    return docs


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """Documents as one multi-document YAML text, keys in the order written."""
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
