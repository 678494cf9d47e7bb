"""Run a training script on torch's elastic agent (torch.distributed.run) with hetrain's settings.

hetrain adds to torchrun the plan (`HETRAIN_PLAN`), on CPU machines emulated device speeds
(`HETRAIN_EMULATE_SPEEDS`), and glibc's malloc told to keep freed memory for reuse, all passed to
every worker through its environment. Processes, rendezvous and restarts are the elastic agent's.

Why the malloc setting: by default glibc returns each large freed block (a batch's activations,
a few MB) to the kernel and maps it again on the next step, so every training step pays for
thousands of page faults on freshly zeroed pages. On a CPU rank that measured 3,000-20,000 faults
and 10-40% of the step time, and in a virtual machine a very uneven cost, which a synchronous job
pays at its slowest rank. With blocks kept and reused the same step takes a few dozen faults.
`--no-malloc-cache` (or setting MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ yourself) keeps
glibc's defaults.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hetrain.errors import HetrainError
from hetrain.metrics.serve import check_ports_free
from hetrain.planning.plan import Plan
from hetrain.runtime.timing import EMULATE_ENV
from hetrain.vocabulary import Env

PLAN_ENV = "HETRAIN_PLAN"
# Largest mmap threshold glibc accepts on 64-bit (32 MiB): blocks below it come from the heap; the
# trim threshold keeps up to 1 GiB of freed heap for reuse instead of returning it each step.
MALLOC_CACHE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
CHECKPOINT_ENV = "HETRAIN_CHECKPOINT_DIR"


@dataclass
class LaunchConfig:
    """What `hetrain launch` was asked for; torchrun's names where they apply."""

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    monitor_interval: float | None = None
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    emulate_speeds: list[float] | None = None
    plan: str | None = None
    checkpoint_dir: str | None = None
    malloc_cache: bool = True
    metrics_port: int | None = None


def _max_nodes(nnodes: str) -> tuple[int, int]:
    try:
        parts = [int(x) for x in nnodes.split(":")]
    except ValueError:
        raise HetrainError(f"--nnodes {nnodes!r} must be a number or MIN:MAX, e.g. 2 or 1:4") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if lo < 1 or hi < lo or len(parts) > 2:
        raise HetrainError(f"--nnodes {nnodes!r} must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def validate(cfg: LaunchConfig) -> None:
    """User errors, each as one line that names the fix."""
    if not cfg.module and not Path(cfg.script).is_file():
        raise HetrainError(f"script {cfg.script!r} does not exist; give the path of a training script")
    if cfg.nproc_per_node < 1:
        raise HetrainError(f"--nproc-per-node must be >= 1, got {cfg.nproc_per_node}")
    if cfg.max_restarts < 0:
        raise HetrainError(f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    lo, hi = _max_nodes(cfg.nnodes)
    if cfg.emulate_speeds is not None:
        for s in cfg.emulate_speeds:
            if not s > 0:
                raise HetrainError(f"speed {s} must be above 0 (1 = full speed, 0.5 = half)")
        world_lo, world_hi = lo * cfg.nproc_per_node, hi * cfg.nproc_per_node
        if lo == hi and len(cfg.emulate_speeds) != world_hi:
            raise HetrainError(
                f"{len(cfg.emulate_speeds)} emulated speeds for {world_hi} ranks; give one speed per rank "
                f"(e.g. --emulate-speeds {','.join(['1'] * world_hi)})"
            )
        if len(cfg.emulate_speeds) < world_hi:
            raise HetrainError(f"give at least {world_hi} emulated speeds, one per rank the job may have (up to {world_hi}); between {world_lo} and {world_hi} ranks may run")
    if cfg.plan is not None:
        Plan.load(cfg.plan)  # raises a one-line error for a missing or invalid plan
    if cfg.metrics_port is not None:
        check_ports_free(cfg.metrics_port, cfg.nproc_per_node)


def torchrun_argv(cfg: LaunchConfig) -> list[str]:
    """The torch.distributed.run command line for this launch."""
    argv = [f"--nproc-per-node={cfg.nproc_per_node}", f"--nnodes={cfg.nnodes}",
            f"--max-restarts={cfg.max_restarts}"]
    if cfg.rdzv_endpoint is None and cfg.nnodes == "1" and cfg.master_addr is None:
        argv.append("--standalone")
    else:
        argv.append(f"--rdzv-backend={cfg.rdzv_backend}")
        if cfg.rdzv_endpoint:
            argv.append(f"--rdzv-endpoint={cfg.rdzv_endpoint}")
        if cfg.rdzv_id:
            argv.append(f"--rdzv-id={cfg.rdzv_id}")
    if cfg.node_rank is not None:
        argv.append(f"--node-rank={cfg.node_rank}")
    if cfg.master_addr:
        argv.append(f"--master-addr={cfg.master_addr}")
    if cfg.master_port:
        argv.append(f"--master-port={cfg.master_port}")
    if cfg.monitor_interval is not None:
        argv.append(f"--monitor-interval={cfg.monitor_interval}")
    if cfg.log_dir:
        argv.append(f"--log-dir={cfg.log_dir}")
    if cfg.module:
        argv.append("--module")
    return [*argv, cfg.script, *cfg.script_args]


def worker_env(cfg: LaunchConfig) -> dict[str, str]:
    env = {}
    if cfg.emulate_speeds is not None:
        env[EMULATE_ENV] = ",".join(f"{s:g}" for s in cfg.emulate_speeds)
    if cfg.plan is not None:
        env[PLAN_ENV] = str(Path(cfg.plan).resolve())
    if cfg.checkpoint_dir is not None:
        env[CHECKPOINT_ENV] = str(Path(cfg.checkpoint_dir).resolve())
    if cfg.metrics_port is not None:
        env[Env.METRICS_PORT] = str(cfg.metrics_port)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node))
    if cfg.malloc_cache and _glibc() and not any(k in os.environ for k in MALLOC_CACHE_ENV):
        env.update(MALLOC_CACHE_ENV)
    return env


def _glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def launch(cfg: LaunchConfig) -> int:
    """Run the job on the elastic agent; returns 0, or raises HetrainError naming the failed rank."""
    validate(cfg)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.update(worker_env(cfg))
    if cfg.emulate_speeds is not None:
        print(f"hetrain launch: emulating device speeds {os.environ[EMULATE_ENV]} on CPU ranks; "
              "all timings from this run are emulated", file=sys.stderr, flush=True)
    args = get_args_parser().parse_args(torchrun_argv(cfg))
    try:
        run(args)
    except ChildFailedError as e:
        first = min(e.failures.items(), key=lambda kv: kv[1].timestamp) if e.failures else None
        if first is None:
            raise HetrainError(f"the job {e.name} failed") from None
        rank, failure = first
        raise HetrainError(
            f"rank {rank} failed with exit code {failure.exitcode} after {cfg.max_restarts} restart(s) "
            f"allowed; its output is above{' and in ' + cfg.log_dir if cfg.log_dir else ''}"
        ) from None
    return 0
