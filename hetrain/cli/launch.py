"""`hetrain launch [torchrun flags] [--emulate-speeds 1,0.5] [--plan plan.json] [--collective-timeout S] script.py [args]`."""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Callable

from hetrain.errors import HetrainError
from hetrain.launch.launcher import HETRAIN_READS_PET, LaunchConfig, launch
from hetrain.runtime.environment import DEFAULT_PROGRESS_TIMEOUT_S
from hetrain.runtime.speeds import parse_speeds


class FromEnv(str):
    """A flag's value read from torchrun's PET_<NAME> variable (`var`), not typed by the user: it is converted in
    launch_config(), whose errors name the variable."""

    var: str


def _pet(name: str, default: object = None) -> object:
    """torchrun's default for a flag: its PET_<NAME> environment variable (set by job operators such as Kubeflow's
    PyTorchJob for each node), else `default`. A flag given on the command line wins, as under torchrun."""
    assert name in HETRAIN_READS_PET, name   # the one list the agent's parser is kept from reading again
    value = os.environ.get(f"PET_{name}")
    if not value:
        return default
    value = FromEnv(value)
    value.var = f"PET_{name}"
    return value


def _typed(convert: Callable[[str], object]) -> Callable[[str], object]:
    """argparse's `type` for a flag with a PET_ default: a value typed on the line is converted (argparse names the
    flag when it is wrong); the variable's is left to launch_config(), which names the variable."""
    @functools.wraps(convert)
    def typed(value: str) -> object:
        return value if isinstance(value, FromEnv) else convert(value)
    return typed


def nproc(value: str) -> int:
    """--nproc-per-node as torchrun reads it: a number, or auto (the CUDA devices, else the CPU cores), gpu, cpu."""
    if value not in ("auto", "gpu", "cpu"):
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: give a number of ranks, or auto, gpu or cpu") from None
    if value == "cpu":
        return os.cpu_count() or 1
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    if value == "gpu":
        raise argparse.ArgumentTypeError("gpu: this machine has no CUDA device; give a number of ranks, or cpu")
    return os.cpu_count() or 1


TYPES: dict[str, Callable[[str], object]] = {"nproc_per_node": nproc, "node_rank": int, "max_restarts": int,
                                             "monitor_interval": float, "master_port": int}
"""The typed flags with PET_ defaults, by their argparse names."""


def build_parser(parser: argparse.ArgumentParser) -> None:
    # Everything after the script is the script's: without abbreviations a script flag that a launcher
    # flag begins with (--n, --log, --max) is not read as an ambiguous launcher flag.
    parser.allow_abbrev = False
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=_typed(nproc), default=_pet("NPROC_PER_NODE", 1),
                        help="worker processes on this node (one per GPU), 1 to 1,024; or auto (one per CUDA device, "
                             "else per CPU core), gpu, cpu (default: 1)")
    parser.add_argument("--nnodes", default=_pet("NNODES", "1"), help="nodes, or MIN:MAX for an elastic job")
    parser.add_argument("--node-rank", "--node_rank", type=_typed(int), default=_pet("NODE_RANK"),
                        help="this node's rank, 0 to nodes - 1: --rdzv-backend static needs it; with --master-addr, "
                             "node rank 0 serves the rendezvous")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", default=_pet("RDZV_BACKEND"),
                        help="c10d (default; at --master-addr:--master-port on several nodes without "
                             "--rdzv-endpoint), or static")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=_pet("RDZV_ENDPOINT"),
                        help="HOST:PORT of the rendezvous")
    parser.add_argument("--rdzv-id", "--rdzv_id", default=_pet("RDZV_ID"), help="job id shared by all nodes")
    parser.add_argument("--rdzv-conf", "--rdzv_conf", default=_pet("RDZV_CONF"), metavar="K=V,...",
                        help="rendezvous settings, e.g. join_timeout=120 (seconds nodes wait for each other; 600), "
                             "read_timeout=10 (seconds per connection attempt to the endpoint; 60)")
    parser.add_argument("--local-addr", "--local_addr", default=_pet("LOCAL_ADDR"),
                        help="this node's address for the rendezvous")
    parser.add_argument("--standalone", action="store_true",
                        default=str(_pet("STANDALONE", "0")).strip().lower() in ("1", "true", "yes"),
                        help="one node with its own local rendezvous")
    parser.add_argument("--max-restarts", "--max_restarts", type=_typed(int), default=_pet("MAX_RESTARTS", 0),
                        help="restart the workers this many times after a failure (default: 0)")
    parser.add_argument("--monitor-interval", "--monitor_interval", type=_typed(float), default=_pet("MONITOR_INTERVAL"),
                        metavar="S", help="seconds between the agent's checks of the workers, above 0 (default: 0.1)")
    parser.add_argument("--master-addr", "--master_addr", default=_pet("MASTER_ADDR"), metavar="HOST",
                        help="several nodes without --rdzv-endpoint: node rank 0's host, where the nodes meet at "
                             "HOST:--master-port (127.0.0.1 when only --master-port is given)")
    parser.add_argument("--master-port", "--master_port", type=_typed(int), default=_pet("MASTER_PORT"), metavar="PORT",
                        help="the port at --master-addr where the nodes meet, 1 to 65535 (29500 when only "
                             "--master-addr is given)")
    parser.add_argument("--log-dir", "--log_dir", default=_pet("LOG_DIR"), help="where the agent writes worker logs")
    parser.add_argument("-r", "--redirects", default=_pet("REDIRECTS"),
                        help="write ranks' streams to files in --log-dir instead of the console (3: both, for every "
                             "local rank; 0:3,1:1: per local rank)")
    parser.add_argument("-t", "--tee", default=_pet("TEE"), help="as --redirects, and to the console too")
    parser.add_argument("--local-ranks-filter", "--local_ranks_filter", default=_pet("LOCAL_RANKS_FILTER"),
                        metavar="R0,R1,...", help="show only these local ranks' output on the console (0: rank 0's, "
                                                  "without its copies from the other ranks)")
    parser.add_argument("--emulate-speeds", "--emulate_speeds", default=None, metavar="S0,S1,...",
                        help="CPU ranks only: relative speed per rank (1 = full, 0.5 = half); output is labelled emulated")
    parser.add_argument("--plan", default=None, help="plan.json written by `hetrain plan --out`")
    parser.add_argument("--checkpoint-dir", "--checkpoint_dir", default=None,
                        help="where sessions save and resume checkpoints")
    parser.add_argument("--run-dir", "--run_dir", default=None, metavar="DIR",
                        help="where the job writes its run log and measured rates, for `hetrain report` and "
                             "`hetrain plan --from-run` (default: --checkpoint-dir, else none)")
    parser.add_argument("--start-fresh", "--start_fresh", action="store_true",
                        help="when no checkpoint in --checkpoint-dir verifies, set them aside and start at step 0")
    parser.add_argument("--metrics-port", "--metrics_port", type=int, default=None, metavar="PORT",
                        help="each local rank serves Prometheus /metrics on PORT + local_rank")
    parser.add_argument("--collective-timeout", "--collective_timeout", type=float, default=None, metavar="S",
                        help="end (or restart) the job when a rank makes no progress for S seconds, naming it "
                             f"(default: {DEFAULT_PROGRESS_TIMEOUT_S:g})")
    parser.add_argument("--no-malloc-cache", "--no_malloc_cache", action="store_true",
                        help="keep glibc's default of returning freed memory to the kernel every step")
    parser.add_argument("-m", "--module", action="store_true", help="run the script as a Python module")
    parser.add_argument("script", nargs="?", help="training script (or module with -m)")   # missing: one line below
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _path(value: str | None) -> str | None:
    """A path flag as given, `~` expanded (not done by the shell after `--flag=`); empty is unset, as an empty
    HETRAIN_CHECKPOINT_DIR is (an empty --checkpoint-dir checkpointed into the working directory)."""
    return os.path.expanduser(value) if value else None


def launch_config(args: argparse.Namespace) -> tuple[LaunchConfig, dict[str, str]]:
    """The launch the parsed flags ask for, and the flags whose value a PET_ variable gave ({"--max-restarts":
    "PET_MAX_RESTARTS"}); a variable's value its flag does not take is refused naming the variable
    (PET_MASTER_PORT=abc was told as an --master-port the user never typed)."""
    if not args.script:   # argparse named script_args, which may be left out, as required too
        raise HetrainError("no training script; give its path after the options: hetrain launch [OPTIONS] train.py "
                           "[ARGS]")
    from_env = {}
    for dest, value in vars(args).items():
        if isinstance(value, FromEnv):
            from_env[_flag(dest)] = value.var
            if dest in TYPES:
                setattr(args, dest, _from_env(value, dest, TYPES[dest]))
    return LaunchConfig(
        script=args.script, script_args=list(args.script_args), module=args.module,
        nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
        rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf, local_addr=args.local_addr, standalone=args.standalone,
        max_restarts=args.max_restarts, monitor_interval=args.monitor_interval,
        master_addr=args.master_addr, master_port=args.master_port, log_dir=_path(args.log_dir),
        redirects=args.redirects, tee=args.tee, local_ranks_filter=args.local_ranks_filter,
        emulate_speeds=parse_speeds(args.emulate_speeds) if args.emulate_speeds else None, plan=_path(args.plan),
        checkpoint_dir=_path(args.checkpoint_dir), run_dir=_path(args.run_dir),
        collective_timeout=args.collective_timeout,
        malloc_cache=not args.no_malloc_cache, metrics_port=args.metrics_port, start_fresh=args.start_fresh,
    ), from_env


def _flag(dest: str) -> str:
    """The flag of an argparse name: --max-restarts for max_restarts."""
    return "--" + dest.replace("_", "-")


def _from_env(value: FromEnv, dest: str, convert: Callable[[str], object]) -> object:
    try:
        return convert(value)
    except (ValueError, argparse.ArgumentTypeError) as e:
        flag = _flag(dest)
        why = f"not a {'whole ' if convert is int else ''}number" if convert in (int, float) else str(e)
        raise HetrainError(f"{value.var}={str(value)!r}, torchrun's default of {flag}: {why}; fix: set {value.var} to "
                           f"what {flag} takes, or unset it") from None


def run(args: argparse.Namespace) -> int:
    cfg, from_env = launch_config(args)
    try:
        return launch(cfg)
    except HetrainError as e:
        if type(e) is not HetrainError or not from_env:   # a stop's exit status (JobStopped) is kept
            raise
        said = str(e)
        for flag, var in from_env.items():   # the value named where it came from, not as a flag never typed
            said = re.sub(rf"(?<![\w-]){flag}(?![\w-])", f"{flag} (from {var})", said, count=1)
        raise HetrainError(said) from None
