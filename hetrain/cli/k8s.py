"""`hetrain k8s --image IMG --script train.py [...]`: write an elastic PyTorchJob manifest."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetrain.cli.console import DefaultsShown
from hetrain.errors import HetrainError
from hetrain.launch.k8s import (K8sJob, catalog_kinds, checkpoint_note, manifests, parse_node_selector, plan_notes,
                                to_yaml, unselected_kinds_note)


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsShown
    parser.add_argument("--image", default=None, help="container image holding hetrain and the script")
    parser.add_argument("--script", default=None, help="training script, as a path inside the image")
    parser.add_argument("--name", default="hetrain", help="job name (lowercase, digits, '-')")
    parser.add_argument("--namespace", default=None, help="namespace of the job (default: kubectl's current one)")
    parser.add_argument("--min-replicas", type=int, default=1, help="fewest worker pods the job runs on")
    parser.add_argument("--max-replicas", type=int, default=None, help="most worker pods (default: min)")
    parser.add_argument("--max-restarts", type=int, default=3, help="worker-group restarts after a failure")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs (and worker processes) per pod")
    parser.add_argument("--plan", default=None, help="plan.json to ship in a ConfigMap and pass to launch")
    parser.add_argument("--node-selector", action="append", default=[], metavar="KIND=KEY=VALUE",
                        help="nodes of GPU kind KIND carry label KEY=VALUE; repeat once per kind")
    parser.add_argument("--checkpoint-pvc", default=None,
                        help="PersistentVolumeClaim (ReadWriteMany) shared by all pods for checkpoints")
    parser.add_argument("--checkpoint-dir", default="/checkpoints",
                        help="where the checkpoints go in each pod: the claim's mount (a job of one pod without a "
                             "claim: a directory of the pod's own)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="each local rank serves Prometheus /metrics on PORT + local_rank (ports metrics-0..)")
    parser.add_argument("--out", default=None, help="write the manifest here (default: stdout)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments for the script, after --: ... --script train.py -- --epochs 3")
    refuse = parser.error

    def error(message: str):
        # argparse reads a script's own flag given before `--` as a mistyped hetrain k8s flag
        if message.startswith("unrecognized arguments: -"):
            message += "; a flag for the script goes after `--` (`hetrain k8s ... --script train.py -- --epochs 3`)"
        refuse(message)

    parser.error = error   # type: ignore[method-assign]


def run(args: argparse.Namespace) -> int:
    plan, plan_json, notes = None, None, []
    selectors = [parse_node_selector(s) for s in args.node_selector]
    if args.plan is not None:
        from hetrain.planning.plan import Plan

        plan = Plan.load(args.plan)  # one-line error when missing or invalid
        notes = plan_notes(plan, args.min_replicas,
                           args.min_replicas if args.max_replicas is None else args.max_replicas, args.gpus_per_node)
        plan_json = Path(args.plan).read_text(encoding="utf-8")
    selectors = catalog_kinds(selectors, plan)
    notes.append(unselected_kinds_note(plan, selectors))
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    job = K8sJob(
        image=args.image or "", script=args.script or "", script_args=script_args, name=args.name,
        namespace=args.namespace, min_replicas=args.min_replicas,
        max_replicas=args.min_replicas if args.max_replicas is None else args.max_replicas,
        max_restarts=args.max_restarts, gpus_per_node=args.gpus_per_node,
        node_selectors=selectors, plan_json=plan_json,
        checkpoint_pvc=args.checkpoint_pvc, checkpoint_dir=args.checkpoint_dir, metrics_port=args.metrics_port,
    )
    text = to_yaml(manifests(job))
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            Path(args.out).write_text(text, encoding="utf-8")
        except OSError as e:
            raise HetrainError(f"cannot write --out {args.out!r} ({e.strerror}); choose a writable path") from None
        print(f"wrote {args.out}", file=sys.stderr)
    for note in [*notes, checkpoint_note(job)]:
        if note is not None:
            print(note, file=sys.stderr)
    return 0
