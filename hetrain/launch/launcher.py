"""Run a training script on torch's elastic agent (torch.distributed.run) with hetrain's settings.

hetrain adds to torchrun the plan (`HETRAIN_PLAN`), on CPU machines emulated device speeds
(`HETRAIN_EMULATE_SPEEDS`), and glibc's malloc told to keep freed memory for reuse, all passed to
every worker through its environment. Processes, rendezvous and restarts are the elastic agent's.

What hetrain adds around them: bad input (a plan naming an unknown device, a port out of range, a
checkpoint directory that cannot be made) is refused before any worker starts; with
`--collective-timeout S` a rank that makes no progress for S seconds ends the job, named
(`HETRAIN_COLLECTIVE_TIMEOUT`, see hetrain.runtime.watchdog); a failed job ends with one line
naming the rank where it began (hetrain.launch.failures); a signal to the launcher is passed to
the workers by the agent and ends it with 128 + the signal's number, SIGTERM to each rank alone
first, so that it saves while its DataLoader workers still serve it (hetrain.launch.graceful_stop).

Workers keep freed memory blocks for reuse instead of faulting them in afresh each step (glibc's
allocator; why, and the setting, in hetrain.malloc_cache). `--no-malloc-cache` (or setting
MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ yourself) keeps glibc's defaults.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hetrain.errors import HetrainError, ranks_text
from hetrain.hardware.catalog import rank_threads
from hetrain.malloc_cache import worker_env as malloc_cache_env
from hetrain.launch.agent_lines import leave_to_the_launcher
from hetrain.launch.failures import (describe, first_failure, is_cause, killed_from_outside, killed_hint,
                                     stopped_on_sigterm)
from hetrain.launch.graceful_stop import GracefulStop, agent_signals
from hetrain.launch.leftovers import adopt_orphans, end_leftovers
from hetrain.metrics.serve import check_ports_free
from hetrain.planning.plan import Plan
from hetrain.userfiles import ensure_directory, is_binary, read_text
from hetrain.vocabulary import CPU_DEVICE, Env

PLAN_ENV = Env.PLAN
# Largest mmap threshold glibc accepts on 64-bit (32 MiB): blocks below it come from the heap; the
# trim threshold keeps up to 1 GiB of freed heap for reuse instead of returning it each step.
CHECKPOINT_ENV = Env.CHECKPOINT_DIR
MAX_NPROC_PER_NODE = 1024
"""Most ranks one node may start: one process per device, each with its own copy of torch."""


class JobStopped(HetrainError):
    """The launcher was stopped by a signal; the CLI exits with 128 + its number, as a shell would."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class LaunchConfig:
    """What `hetrain launch` was asked for; torchrun's names where they apply."""

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_backend: str | None = None   # None: c10d (`rendezvous_backend`)
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None
    """torch's rendezvous settings, e.g. join_timeout=120 (seconds the nodes wait for each other; 600)"""
    local_addr: str | None = None
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float | None = None
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    redirects: str | None = None
    """torchrun's: ranks' streams to files in log_dir (3, or per local rank 0:3,1:1)"""
    tee: str | None = None
    local_ranks_filter: str | None = None
    """torchrun's: the local ranks whose output reaches the console (e.g. "0")"""
    emulate_speeds: list[float] | None = None
    plan: str | None = None
    checkpoint_dir: str | None = None
    run_dir: str | None = None
    """where the run log and measured rates go (HETRAIN_RUN_DIR); else the checkpoint directory"""
    collective_timeout: float | None = None
    """seconds a rank may make no progress before the job ends naming it (HETRAIN_COLLECTIVE_TIMEOUT)"""
    malloc_cache: bool = True
    metrics_port: int | None = None
    start_fresh: bool = False
    """set damaged checkpoints aside and start at step 0 when none verifies (HETRAIN_START_FRESH)"""


def stopped_line(sig: signal.Signals) -> str:
    """The launcher's last line when a signal stopped the job: what the workers did with it."""
    if sig == signal.SIGTERM:
        return ("the job was stopped by SIGTERM; every worker was sent SIGTERM (a hetrain.Session saves the step "
                "in flight and stops, where checkpoints are on)")
    return (f"the job was stopped by {sig.name}; every worker was sent {sig.name}, which stops a rank where it "
            "is, without saving: the newest checkpoint is the last one saved; to save the step in flight, "
            "stop a job with SIGTERM (kill PID)")


def _max_nodes(nnodes: str) -> tuple[int, int]:
    try:
        parts = [int(x) for x in nnodes.split(":")]
    except ValueError:
        raise HetrainError(f"--nnodes {nnodes!r} must be a number or MIN:MAX, e.g. 2 or 1:4") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if lo < 1 or hi < lo or len(parts) > 2:
        raise HetrainError(f"--nnodes {nnodes!r} must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def check_endpoint(endpoint: str) -> None:
    """HOST or HOST:PORT (an IPv6 host in brackets), the port a TCP port: one line naming the fix otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or endpoint.endswith("]") or (host.count(":") and not host.startswith("[")):
        host, port = endpoint, None   # no port: a name, a bracketed IPv6 address, or one without brackets
    if not host.strip("[]"):
        raise HetrainError(f"--rdzv-endpoint {endpoint!r} names no host; fix: give HOST:PORT, e.g. node0:29400")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise HetrainError(f"--rdzv-endpoint {endpoint!r}: {port!r} is not a TCP port; fix: use HOST:PORT with a port "
                           "from 1 to 65535, e.g. node0:29400")


def rendezvous_backend(cfg: LaunchConfig) -> str:
    """The rendezvous torchrun runs: the one given, else c10d (which `--nnodes MIN:MAX` and restarts need)."""
    return cfg.rdzv_backend or "c10d"


def rendezvous_at(cfg: LaunchConfig) -> str | None:
    """The c10d rendezvous endpoint: the one given, else, for torchrun's classic multi-node command
    (`--master-addr HOST --master-port PORT` on every node), HOST:PORT, served by node rank 0. torchrun
    reads those flags only under its static rendezvous (a fixed number of nodes); c10d ignores them, and
    every node would wait alone at its own localhost:29400."""
    if cfg.rdzv_endpoint or rendezvous_backend(cfg) != "c10d" or _max_nodes(cfg.nnodes)[1] == 1:
        return cfg.rdzv_endpoint
    if cfg.master_addr is None and cfg.master_port is None:
        return None
    return f"{cfg.master_addr or '127.0.0.1'}:{cfg.master_port or 29500}"


def rendezvous_endpoint(cfg: LaunchConfig) -> str:
    """Where the nodes meet, in words for a message."""
    if rendezvous_backend(cfg) == "static":
        return cfg.rdzv_endpoint or f"{cfg.master_addr or '127.0.0.1'}:{cfg.master_port or 29500}"
    return rendezvous_at(cfg) or "the default endpoint (localhost:29400)"


def check_rendezvous(cfg: LaunchConfig, lo: int, hi: int) -> None:
    """torchrun's static rendezvous (asked for by name) on several nodes: a fixed count, each node's rank."""
    if rendezvous_backend(cfg) != "static" or hi == 1:
        return
    if lo != hi:
        raise HetrainError(f"--nnodes {cfg.nnodes} asks for an elastic job, and --rdzv-backend static runs a fixed "
                           "number of nodes; leave --rdzv-backend out (c10d)")
    if cfg.node_rank is None or not 0 <= cfg.node_rank < hi:
        raise HetrainError(f"--rdzv-backend static on {hi} nodes needs each node's --node-rank, 0 to {hi - 1} (0 on "
                           "the --master-addr host)")


# torch's rendezvous settings read as whole numbers (seconds, or a count; torch's default), and those read as words
RDZV_CONF_INTS = {"join_timeout": 600, "last_call_timeout": 30, "close_timeout": 30, "heartbeat_timeout": 5,
                  "read_timeout": 60, "timeout": 600, "keep_alive_interval": 5, "keep_alive_max_attempt": 3}
RDZV_CONF_WORDS = {"is_host": "1 true t yes y 0 false f no n", "store_type": "tcp file"}
STREAMS = re.compile(r"[0123]|(\d:[0123],)*\d:[0123]")   # torchrun's --redirects and --tee (Std.from_str)


def check_rdzv_conf(conf: str, backend: str) -> None:
    """--rdzv-conf K=V,... as torch's rendezvous reads it (the agent raised a traceback); other keys pass as given."""
    for key, eq, value in ((p.strip() for p in kv.partition("=")) for kv in filter(str.strip, conf.split(","))):
        if not (key and eq and value):
            raise HetrainError(f"--rdzv-conf {conf!r}: {key or value!r} is not KEY=VALUE; fix: write KEY=VALUE "
                               "settings joined by commas, e.g. join_timeout=120,read_timeout=10")
        if key in RDZV_CONF_INTS and not (value.isdigit() and int(value) > 0):   # torch refuses a timeout <= 0
            raise HetrainError(f"--rdzv-conf {key}={value}: {key} must be a whole number above 0, e.g. "
                               f"{key}={RDZV_CONF_INTS[key]} (torch's default)")
        words = RDZV_CONF_WORDS.get(key, "").split() if key != "store_type" or backend == "c10d" else []
        if words and value.lower() not in words:
            raise HetrainError(f"--rdzv-conf {key}={value}: {key} must be one of {', '.join(words)}")


def check_backend(name: str) -> None:
    """A rendezvous torch has: c10d, static, etcd and etcd-v2 (with the python-etcd package), or a plugin's."""
    from importlib import metadata, util

    if name in ("etcd", "etcd-v2") and util.find_spec("etcd") is None:
        raise HetrainError(f"--rdzv-backend {name} needs the python-etcd package and an etcd server; fix: leave "
                           "--rdzv-backend out (c10d, served by one of the nodes)")
    if name not in ("c10d", "static", "etcd", "etcd-v2", *(e.name for e in metadata.entry_points(group="torchrun.handlers"))):
        raise HetrainError(f"--rdzv-backend {name!r} is not a rendezvous torch has; fix: use c10d (the default) or static")


def validate(cfg: LaunchConfig) -> None:
    """User errors, each as one line that names the fix."""
    if not cfg.module and not Path(cfg.script).is_file():
        what = "is a directory" if Path(cfg.script).is_dir() else "does not exist"
        raise HetrainError(f"script {cfg.script!r} {what}; give the path of a training script")
    if not cfg.module and is_binary(cfg.script):
        raise HetrainError(f"script {cfg.script!r} is a binary file, not a Python script; give the path of a "
                           "training script (.py)")
    if not 1 <= cfg.nproc_per_node <= MAX_NPROC_PER_NODE:
        raise HetrainError(f"--nproc-per-node must be from 1 to {MAX_NPROC_PER_NODE:,} (one rank per device on "
                           f"this node), got {cfg.nproc_per_node:,}")
    if cfg.max_restarts < 0:
        raise HetrainError(f"--max-restarts must be >= 0, got {cfg.max_restarts}")
    lo, hi = _max_nodes(cfg.nnodes)
    if cfg.standalone and hi > 1:
        raise HetrainError(f"--standalone runs one node with its own rendezvous, and --nnodes is {cfg.nnodes}: no "
                           "other node can join it; drop --standalone and give every node --rdzv-endpoint HOST:PORT")
    if cfg.emulate_speeds is not None:
        for s in cfg.emulate_speeds:
            if not 0 < s <= 1:
                raise HetrainError(f"speed {s} must be above 0 and at most 1 (1 = full speed, 0.5 = half)")
        if hi == 1 and len(cfg.emulate_speeds) != cfg.nproc_per_node:
            raise HetrainError(
                f"{len(cfg.emulate_speeds)} emulated speeds for {cfg.nproc_per_node} ranks; give one speed per rank "
                f"(e.g. --emulate-speeds {','.join(['1'] * cfg.nproc_per_node)})"
            )
        # on several nodes the job's ranks are every node's --nproc-per-node together, which no one launcher
        # knows: every node passes the same list, one speed per rank of the job, and the ranks check its length
        if len(cfg.emulate_speeds) < cfg.nproc_per_node:
            raise HetrainError(f"{len(cfg.emulate_speeds)} emulated speeds, fewer than this node's "
                               f"{cfg.nproc_per_node} ranks; give every node the same list, one speed per rank of "
                               "the whole job (on several nodes the rendezvous numbers the ranks by node address)")
    if cfg.rdzv_endpoint:
        check_endpoint(cfg.rdzv_endpoint)
    check_rendezvous(cfg, lo, hi)
    if cfg.master_port is not None and not 1 <= cfg.master_port <= 65535:
        raise HetrainError(f"--master-port {cfg.master_port} is not a TCP port; fix: use a port from 1 to 65535, e.g. 29500")
    if cfg.rdzv_backend is not None:
        check_backend(cfg.rdzv_backend)
    if cfg.rdzv_conf:
        check_rdzv_conf(cfg.rdzv_conf, rendezvous_backend(cfg))
    if cfg.monitor_interval is not None and not (math.isfinite(cfg.monitor_interval) and cfg.monitor_interval > 0):
        raise HetrainError(f"--monitor-interval {cfg.monitor_interval:g} must be a positive number of seconds, e.g. 0.1")
    for flag, value in (("--redirects", cfg.redirects), ("--tee", cfg.tee)):
        if value and not STREAMS.fullmatch(value):
            raise HetrainError(f"{flag} {value!r} must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local "
                               "rank R:N joined by commas (local ranks 0-9), e.g. 0:3,1:1")
    if cfg.local_ranks_filter and not all(r.strip().isdigit() for r in cfg.local_ranks_filter.split(",")):
        raise HetrainError(f"--local-ranks-filter {cfg.local_ranks_filter!r} must be local ranks, e.g. 0 or 0,1")
    if cfg.collective_timeout is not None and not (math.isfinite(cfg.collective_timeout) and cfg.collective_timeout > 0):
        raise HetrainError(f"--collective-timeout {cfg.collective_timeout} must be a positive number of seconds, e.g. 600")
    for flag, path in (("--checkpoint-dir", cfg.checkpoint_dir), ("--run-dir", cfg.run_dir), ("--log-dir", cfg.log_dir)):
        if path is not None:   # torch's agent makes --log-dir too, and raised a traceback where it is a file
            ensure_directory(path, flag)
    if cfg.plan is not None:
        check_plan_devices(load_plan(cfg.plan))
    if cfg.metrics_port is not None:
        check_ports_free(cfg.metrics_port, cfg.nproc_per_node)


def load_plan(path: str) -> Plan:
    """The plan at `path`; a missing, binary or invalid file is a one-line error."""
    return Plan.from_json(read_text(path, "plan file"), source=path)


def check_plan_devices(plan: Plan) -> None:
    """Every rank's device is 'cpu' or in the GPU catalog (an unknown name lists the closest)."""
    from hetrain.hardware.catalog import get_gpu

    for rank in plan.ranks:
        if rank.device != CPU_DEVICE:
            try:
                get_gpu(rank.device)
            except HetrainError as e:
                raise HetrainError(f"plan rank {rank.rank}: {e}; fix: write a catalog name in its \"device\"") from None


def torchrun_argv(cfg: LaunchConfig) -> list[str]:
    """The torch.distributed.run command line for this launch."""
    argv = [f"--nproc-per-node={cfg.nproc_per_node}", f"--nnodes={cfg.nnodes}",
            f"--max-restarts={cfg.max_restarts}"]
    endpoint = rendezvous_at(cfg)
    # one node without an endpoint: a rendezvous of its own on a free port (two jobs on a host never meet)
    if cfg.standalone or (cfg.rdzv_endpoint is None and _max_nodes(cfg.nnodes)[1] == 1
                          and rendezvous_backend(cfg) == "c10d"):
        argv.append("--standalone")
    else:
        argv.append(f"--rdzv-backend={rendezvous_backend(cfg)}")
        if endpoint:
            argv.append(f"--rdzv-endpoint={endpoint}")
        if cfg.rdzv_id:
            argv.append(f"--rdzv-id={cfg.rdzv_id}")
    conf = [kv for kv in (cfg.rdzv_conf or "").split(",") if kv.strip()]
    if endpoint and not cfg.rdzv_endpoint and cfg.node_rank is not None and \
            not any(kv.strip().startswith("is_host=") for kv in conf):
        # torch finds the node that serves it by matching the endpoint's host to its own names and addresses,
        # which misses a second network's address or an alias: the master is node rank 0
        conf.append(f"is_host={int(cfg.node_rank == 0)}")
    if conf:
        argv.append(f"--rdzv-conf={','.join(conf)}")
    if cfg.local_addr:
        argv.append(f"--local-addr={cfg.local_addr}")
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
    for flag, value in (("--redirects", cfg.redirects), ("--tee", cfg.tee), ("--local-ranks-filter", cfg.local_ranks_filter)):
        if value:
            argv.append(f"{flag}={value}")
    if cfg.module:
        argv.append("--module")
    # after "--" the script and its arguments are read as they were given (a "--" among them included)
    return [*argv, "--", cfg.script, *cfg.script_args]


SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"   # torch's rendezvous reads it in the agent


def worker_env(cfg: LaunchConfig) -> dict[str, str]:
    lo, hi = _max_nodes(cfg.nnodes)
    env = {Env.NNODES: str(lo) if lo == hi else f"{lo}:{hi}"}   # "2" and "2:2" alike
    if cfg.emulate_speeds is not None:
        env[Env.EMULATE_SPEEDS] = ",".join(f"{s:g}" for s in cfg.emulate_speeds)
    if cfg.plan is not None:
        env[PLAN_ENV] = str(Path(cfg.plan).resolve())
    if cfg.checkpoint_dir is not None:
        env[CHECKPOINT_ENV] = str(Path(cfg.checkpoint_dir).resolve())
    if cfg.run_dir is not None:
        env[Env.RUN_DIR] = str(Path(cfg.run_dir).resolve())
    if cfg.metrics_port is not None:
        env[Env.METRICS_PORT] = str(cfg.metrics_port)
    if cfg.collective_timeout is not None:
        env[Env.COLLECTIVE_TIMEOUT] = f"{cfg.collective_timeout:g}"
    if cfg.start_fresh:
        env[Env.START_FRESH] = "1"
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(rank_threads(cfg.nproc_per_node))
    if _max_nodes(cfg.nnodes)[1] > 1 and SHARED_STORE_OPT_OUT not in os.environ:
        # Several nodes: each attempt's ranks get a store of their own (hosted by rank 0) instead of
        # the rendezvous store shared across attempts, which a node coming back cannot rejoin through.
        env[SHARED_STORE_OPT_OUT] = "1"
    if cfg.malloc_cache:
        env.update(malloc_cache_env())
    return env


HETRAIN_READS_PET = frozenset((
    "NPROC_PER_NODE", "NNODES", "NODE_RANK", "RDZV_BACKEND", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_CONF", "LOCAL_ADDR",
    "STANDALONE", "MAX_RESTARTS", "MONITOR_INTERVAL", "MASTER_ADDR", "MASTER_PORT", "LOG_DIR", "REDIRECTS", "TEE",
    "LOCAL_RANKS_FILTER"))   # hetrain.cli.launch's flags with torchrun's environment defaults


def agent_args(cfg: LaunchConfig) -> Any:
    """The elastic agent's arguments (torchrun's parser). No abbreviations: a script's own `--n 64` is the
    script's, not an ambiguous launcher option."""
    from torch.distributed.run import get_args_parser

    # torchrun's PET_* defaults of the flags hetrain reads were read by its own parser and are passed explicitly
    # where set; torch's parser would read them again, raw (PET_STANDALONE=false, an empty PET_MASTER_PORT failed)
    read = {k: os.environ.pop(k) for k in list(os.environ) if k.removeprefix("PET_") in HETRAIN_READS_PET}
    try:
        parser = get_args_parser()
        parser.allow_abbrev = False
        args = parser.parse_args(torchrun_argv(cfg))
    finally:
        os.environ.update(read)
    if hasattr(args, "signals_to_handle"):   # torchrun's option where it has one; an older agent takes SIGTERM back
        args.signals_to_handle = agent_signals(args.signals_to_handle)
    return args


def launch(cfg: LaunchConfig) -> int:
    """Run the job on the elastic agent; returns 0, or raises HetrainError naming the failed rank."""
    validate(cfg)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    # the agent hands its own environment to the workers; this process's is restored afterwards, so
    # that one launch's settings (a plan, emulated speeds, the allocator's) never reach the next
    saved = dict(os.environ)
    os.environ.update(worker_env(cfg))
    if cfg.emulate_speeds is not None:
        print(f"hetrain launch: emulating device speeds {os.environ[Env.EMULATE_SPEEDS]} on CPU ranks; "
              "all timings from this run are emulated", file=sys.stderr, flush=True)
    # the ranks' error files go to a folder of the launcher's (a restart's line names who failed from them)
    log_dir = cfg.log_dir or (None if cfg.redirects or cfg.tee else tempfile.mkdtemp(prefix="hetrain-launch-"))
    args = agent_args(replace(cfg, log_dir=log_dir))
    launch_id = adopt_orphans()
    stop = GracefulStop(launch_id)
    stop.install()
    agent_lines_back = leave_to_the_launcher(_max_nodes(cfg.nnodes)[1] == 1, log_dir, remove=log_dir != cfg.log_dir)
    try:
        run(args)
    except ChildFailedError as e:
        if stopped_on_sigterm(e.failures):   # saved and stopped: the exit status a requeue script looks for
            raise JobStopped(failure_line(e.failures, cfg), 128 + int(signal.SIGTERM)) from None
        raise HetrainError(failure_line(e.failures, cfg)) from None
    except RendezvousError as e:
        raise HetrainError(rendezvous_line(e, cfg)) from None
    except SignalException as e:
        raise JobStopped(stopped_line(signal.Signals(e.sigval)), 128 + int(e.sigval)) from None
    finally:
        agent_lines_back()
        stop.uninstall()
        os.environ.clear()
        os.environ.update(saved)
        ended = end_leftovers(launch_id)
        if ended:
            print(f"hetrain launch: ended {len(ended)} process(es) the workers left running (pids "
                  f"{', '.join(map(str, ended))}); a worker's children should end with it", file=sys.stderr, flush=True)
    return 0


def rendezvous_line(error: BaseException, cfg: LaunchConfig) -> str:
    """The launcher's one line when the nodes could not meet (torch's rendezvous raised)."""
    endpoint = rendezvous_endpoint(cfg)
    timeout = next((kv.split("=", 1)[1] for kv in (cfg.rdzv_conf or "").split(",")
                    if kv.strip().startswith("join_timeout=")), "600")
    said = str(error).strip().splitlines()
    detail = f" ({said[0][:200]})" if said else ""
    same = (f"every node must run hetrain launch with the same --nnodes (here {cfg.nnodes}), --rdzv-endpoint and "
            "--rdzv-id")
    if cfg.node_rank is not None and not cfg.rdzv_endpoint:   # --master-addr: the node of --node-rank 0 serves it
        same += f", and exactly one node --node-rank 0 (this one has {cfg.node_rank})"
    kind = type(error).__name__
    if kind == "RendezvousTimeoutError":
        return (f"the nodes did not all arrive at the rendezvous at {endpoint} within {timeout} s{detail}: {same}, "
                "and reach that endpoint; --rdzv-conf join_timeout=S sets the wait")
    if kind == "RendezvousConnectionError":
        return (f"cannot reach the rendezvous at {endpoint}{detail}: the node that serves it (the endpoint's host) is "
                "not running, or ended (a job that failed there ends it: that node's output says why); fix "
                f"--rdzv-endpoint HOST:PORT or start that node; {same}")
    if kind == "RendezvousClosedError":
        return (f"the rendezvous at {endpoint} is closed{detail}: the job it served ended; start every node again, "
                "or give a new --rdzv-id")
    return f"the rendezvous at {endpoint} failed ({kind}{': ' + said[0][:200] if said else ''}); {same}"


def _streams(value: str | None, local_rank: int) -> int:
    """torchrun's --redirects/--tee for one local rank: 0 none, 1 stdout, 2 stderr, 3 both ("3", or "0:3,1:1")."""
    if value and ":" in value:   # (validate() checked its form)
        return dict((int(r), int(v)) for r, v in (part.split(":") for part in value.split(","))).get(local_rank, 0)
    return int(value) if value else 0


def output_place(cfg: LaunchConfig, local_rank: int) -> str:
    """Where a failed rank's output is: above, unless the console does not show it."""
    files = f" and in {cfg.log_dir}" if cfg.log_dir else ""
    if _streams(cfg.redirects, local_rank) & 2 and not _streams(cfg.tee, local_rank) & 2:   # its stderr, the error
        return (f"its output is in {cfg.log_dir} (--redirects)" if cfg.log_dir else
                "its output went to the agent's files in a temporary folder (--redirects without --log-dir)")
    shown = [part.strip() for part in (cfg.local_ranks_filter or "").split(",") if part.strip()]
    if shown and str(local_rank) not in shown:
        return f"its output is not on the console (--local-ranks-filter {cfg.local_ranks_filter}){files}"
    return f"its output is above{files}"


def failure_line(failures: dict[int, Any], cfg: LaunchConfig) -> str:
    """The launcher's one line for a failed job: the rank that failed first, and why."""
    if not failures:
        return "the job failed before any worker reported"
    rank, failure = first_failure(failures)
    where = output_place(cfg, getattr(failure, "local_rank", rank))
    echoes = not any(is_cause(f) for f in failures.values())
    one_node = _max_nodes(cfg.nnodes)[1] == 1
    returned = sorted(set(range(cfg.nproc_per_node)) - set(failures)) if one_node else []
    if stopped_on_sigterm(failures):   # saved and stopped: the ranks got SIGTERM before this launcher
        return ("every rank stopped on a SIGTERM a worker received (not this launcher): a hetrain.Session saves the "
                "step in flight on every rank and stops, where checkpoints are on (each rank's output says which "
                f"step); run the same command again to resume; {where}")
    if one_node and killed_from_outside(failures):   # (several nodes' agents stop workers when a node leaves)
        # the agent stops the others with SIGTERM too, recorded alike and in the same second: one is not told
        # from the others where there are several
        killed = f"{describe(rank, failure)}" if len(failures) == 1 else \
            f"{ranks_text(sorted(failures))} were killed by SIGTERM, the first of them"
        return (f"{killed} from outside the job (no rank had failed before it, so neither this launcher nor the agent "
                "sent it: a kill, a scheduler's signal to one process); a hetrain.Session saves and stops on SIGTERM, "
                f"a script without one ends there; {where}")
    if echoes and returned:   # the others only lost a peer that had ended as if done
        return (f"{ranks_text(returned)} ended with exit code 0 while the others were in a step "
                f"({describe(rank, failure)}): a script that returns on some ranks only (a break, return or "
                "sys.exit(0) on one rank) leaves the others waiting on it; every rank takes the same steps (end the "
                f"loop on session.step_count or the loader's epoch) and calls session.close(); {where}")
    if _max_nodes(cfg.nnodes)[1] > 1 and echoes:
        # every rank here only lost its peers: the first failure was a rank on another node
        return (f"every rank on this node lost its peers ({describe(rank, failure)}): the failure began on another "
                f"node, whose output says which rank and why; the job ended after {cfg.max_restarts} restart(s) "
                f"allowed; {where}")
    return (f"{describe(rank, failure)}; the job ended after {cfg.max_restarts} restart(s) allowed; "
            f"{where}{killed_hint(failure.exitcode)}")
