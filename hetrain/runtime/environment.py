"""One rank's environment: who it is (rank, world, restart), its device, its process group, its log.

The launcher (`hetrain launch`, or plain torchrun) sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; a script started by hand runs as a single rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import inspect
import itertools
import logging
import operator
import os
import re
import sys
import time
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError, add_note
from hetrain.exiting import once_at_exit
from hetrain.vocabulary import Env

log = logging.getLogger("hetrain")

DEFAULT_PROGRESS_TIMEOUT_S = 300.0
"""Seconds a rank may make no progress before the job ends naming it (HETRAIN_COLLECTIVE_TIMEOUT)."""


def whole_number(value: Any) -> int | None:
    """`value` as an int where it is a whole number (a NumPy integer too), else None (a bool is not one)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def env_int(name: str, default: int) -> int:
    """An integer environment variable; a one-line error naming it when it is not one."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise HetrainError(f"{name}={value!r} is not an integer; set it to a whole number or unset it") from None


def env_float(name: str, default: float, *, positive: bool = True) -> float:
    """A float environment variable (finite, and > 0 when `positive`); one line naming it otherwise."""
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not (number == number and abs(number) != float("inf")) or (positive and number <= 0):
        raise HetrainError(f"{name}={value!r} must be a finite number{' above 0' if positive else ''} "
                           "(seconds); set it to e.g. 30 or unset it")
    return number


@dataclass(frozen=True)
class RankEnv:
    """What the launcher told this process."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int
    run_id: str

    @classmethod
    def from_environ(cls) -> "RankEnv":
        check_torch(torch.__version__)
        _ranks_from_slurm()
        rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
        if world < 1 or not 0 <= rank < world:
            raise HetrainError(f"RANK={rank} and WORLD_SIZE={world} do not describe a rank of a job; "
                               "start the script with `hetrain launch --nproc-per-node N script.py`")
        return cls(rank=rank, world_size=world, local_rank=env_int("LOCAL_RANK", 0),
                   restart_count=env_int("TORCHELASTIC_RESTART_COUNT", 0),
                   run_id=os.environ.get("TORCHELASTIC_RUN_ID", "local"))


OLDEST_TORCH = (2, 11)   # as pyproject.toml requires: older pipelining, DCP readers and gloo's AVG differ


def check_torch(version: str) -> None:
    """Refuse a torch older than OLDEST_TORCH (installed beside hetrain without its requirement: `--no-deps`)."""
    found = tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])
    if found < OLDEST_TORCH:
        raise HetrainError(f"hetrain needs torch {'.'.join(map(str, OLDEST_TORCH))} or later, and this is torch "
                           f"{version}: its pipeline schedules, sharded checkpoint readers and FSDP2 on gloo differ; "
                           f"fix: pip install 'torch>={'.'.join(map(str, OLDEST_TORCH))}'")


def _ranks_from_slurm() -> None:
    """A process `srun` started as one task of several (no launcher: RANK and WORLD_SIZE unset) takes its
    rank from Slurm's task variables, which `hetrain launch` and torchrun would otherwise have set; without
    a rendezvous address every task silently trained a one-rank job of its own."""
    tasks = os.environ.get("SLURM_NTASKS", "")
    if dist.is_initialized():   # the script started its group (mp.spawn per GPU under one task a node): its ranks
        return
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ or "SLURM_STEP_ID" not in os.environ \
            or not tasks.isdigit() or int(tasks) < 2:
        return
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise HetrainError(
            f"this process is one of {tasks} tasks srun started (SLURM_NTASKS={tasks}), with no rank of a job: "
            "start one `hetrain launch --nnodes $SLURM_NNODES --nproc-per-node GPUS --rdzv-backend c10d "
            "--rdzv-endpoint HEAD:29500 --rdzv-id $SLURM_JOB_ID script.py` per node (srun --ntasks-per-node=1), "
            "or export MASTER_ADDR (the first node's host) and MASTER_PORT so that each task is a rank "
            "(docs/runtime.md, Schedulers)")
    os.environ.update({"RANK": os.environ.get("SLURM_PROCID", "0"), "WORLD_SIZE": tasks,
                       "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0")})


def pick_device(local_rank: int, device: str | torch.device | None = None) -> torch.device:
    """The device given, else this local rank's GPU, else the CPU."""
    if device is not None:
        chosen = torch.device(device)
        if chosen.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise HetrainError(f"Session(device={str(device)!r}): torch sees no CUDA device on this machine "
                                   "(torch.cuda.is_available() is False); leave device= unset to take this rank's "
                                   "GPU where there is one and the CPU elsewhere")
            if chosen.index is None:
                return torch.device("cuda", local_rank % count)   # "cuda": this local rank's GPU
            if chosen.index >= count:
                raise HetrainError(f"Session(device={str(device)!r}): this machine has {count} CUDA device(s), "
                                   f"cuda:0..cuda:{count - 1}; leave device= unset to take this local rank's own GPU")
        return chosen
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def progress_timeout() -> float:
    """Seconds without progress after which the job ends, naming the rank (HETRAIN_COLLECTIVE_TIMEOUT)."""
    return env_float(Env.COLLECTIVE_TIMEOUT, DEFAULT_PROGRESS_TIMEOUT_S)


def collective_timeout() -> datetime.timedelta:
    """How long a collective waits for a peer: past the progress watch's timeout, so that the watch
    (which names the rank the others wait on) speaks first and the collective's error never does."""
    t = progress_timeout()
    return datetime.timedelta(seconds=max(2 * t, t + 30))


EXIT_SETTLE_S = 0.05
"""How long a rank, at exit, leaves the interpreter lock to gloo's worker threads (see `settle_at_exit`)."""


def settle_at_exit() -> None:
    """At exit, while the interpreter is whole: collect unreachable objects, then give gloo's worker
    threads the interpreter lock for a moment.

    A gloo worker frees each finished collective's tensors itself, after the rank's wait on it has
    returned; a tensor the script has already dropped is freed with the lock held. A barrier holds the
    collectives still in flight when it began, so the last ones are freed by the worker only when the
    closing barrier is, which can be after the script's last line. A worker that asks for the lock
    once the interpreter is finalizing is ended by Python inside a torch destructor, and the rank dies
    with SIGABRT ("terminate called without an active exception") after its work is done: a clean job
    reported as a failed one (2 of 55 runs of a 2-rank job here; in the core dump a gloo thread in
    ~AsyncBarrierWork -> ~AsyncAllgatherWork -> THPVariable_dealloc -> PyThread_exit_thread).
    Sleeping releases the lock, so a worker waiting for it finishes first. The collection frees a
    DistributedDataParallel model's reference cycles while the interpreter still runs.

    What is left is then frozen, as `collect_then_freeze` does: the teardown does not walk torch's heap
    again (about 0.7 s of every rank's exit here).

    The collection runs before torch's own exit hook, which tells DataLoader iterators that the process
    is exiting; a loader iterator in a reference cycle (a generator method of the script's trainer
    object) would otherwise be finalised here the slow way, joining each worker for 5 s before killing
    it. `_data_loaders_exiting` raises that flag first, as torch does a moment later: the daemonic
    workers end with the process."""
    with _data_loaders_exiting():
        gc.collect()
    time.sleep(EXIT_SETTLE_S)
    gc.freeze()


@contextlib.contextmanager
def _data_loaders_exiting() -> Iterator[None]:
    """While it lasts, the flag torch's exit hook sets, by which a DataLoader iterator finalised at exit
    leaves its workers to the process's end (`settle_at_exit`); exit hooks that run after the collection
    (the script's own, registered earlier) see it as they did."""
    from torch.utils.data import _utils as data_utils

    before = getattr(data_utils, "python_exit_status", None)
    if before is not None:
        data_utils.python_exit_status = True
    try:
        yield
    finally:
        if before is not None:
            data_utils.python_exit_status = before


def collect_at_exit() -> None:
    """Register `settle_at_exit` for this process, once. Called when a rank joins its process group."""
    once_at_exit(settle_at_exit)


_GROUPS = itertools.count()   # process groups this process has started: every rank starts them in one order
_TORCH_PREFIXED = "_hetrain_torch_prefixed"   # marks torch's "[rankN]: " excepthook set by a session's first group


@contextlib.contextmanager
def _one_rank_prefix() -> Iterator[None]:
    """torch's init_process_group wraps sys.excepthook to prefix "[rankN]: " each time it runs: a process whose
    sessions start one group after another kept one wrapper per group ("[rank0]: [rank0]: ..."). The first
    stays; a later group's is taken off again."""
    before = sys.excepthook
    try:
        yield
    finally:
        if getattr(before, _TORCH_PREFIXED, False):
            sys.excepthook = before
        elif sys.excepthook is not before:
            setattr(sys.excepthook, _TORCH_PREFIXED, True)


_LEFT_OPEN: list[Any] = []   # the group a session that started it could not leave (it closed on an error)


def leave_group(failing: bool, settle: Callable[[], Any] | None) -> None:
    """A session leaves the process group it started. Closing on an error, it stays (leaving means meeting peers
    that may be inside a step): the next session of this process leaves it and starts its own."""
    if failing:
        _LEFT_OPEN[:] = [dist.group.WORLD]
        return
    if settle is not None:   # every rank gets here, its last balancer exchange landed, before the group goes
        settle()
    dist.barrier()   # destroying gloo's group while a peer is still in a collective can abort at exit
    dist.destroy_process_group()


def check_script_group(env: RankEnv, backend: str | None) -> None:
    """A group the script started is the job's: one of another size than the launcher's (each process a one-rank
    group of its own) trained the whole global batch on every process, and their checkpoints overwrote each other."""
    if "WORLD_SIZE" in os.environ and dist.get_world_size() != env.world_size:
        raise HetrainError(
            f"the process group the script started has {dist.get_world_size()} rank(s), but the launcher started "
            f"{env.world_size} (WORLD_SIZE): start it with dist.init_process_group() over the launcher's ranks "
            "(no rank=/world_size= of its own), or leave it to hetrain.Session()")
    if backend is not None and dist.get_backend() != backend:
        raise HetrainError(f"Session(backend={backend!r}): the process group the script started uses "
                           f"{dist.get_backend()}; start it with {backend}, or leave backend= unset")


def init_process_group(env: RankEnv, device: torch.device, backend: str | None = None) -> tuple[bool, Any]:
    """Join the job's process group (NCCL on CUDA, gloo on CPU). Returns (whether this call created it,
    a store of the job that other services may use, or None). A group the script started itself
    is used as it is; either way the rank collects at exit (`collect_at_exit`)."""
    collect_at_exit()
    if dist.is_initialized() and _LEFT_OPEN and _LEFT_OPEN[0] is dist.group.WORLD:
        # the group of a session that closed on an error (it could not meet its peers to leave): a sweep's next
        # trial ran on it without a progress watch; it is left now, and a new one made as for any session
        _LEFT_OPEN.clear()
        dist.destroy_process_group()
    if dist.is_initialized():
        check_script_group(env, backend)
        return False, None
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = collective_timeout()
    # a MASTER_ADDR left in the shell, without a launcher's WORLD_SIZE, is no job of several ranks: a one-process
    # run read MASTER_PORT (a KeyError) or waited 600 s on another host's address
    if "MASTER_ADDR" in os.environ and ("WORLD_SIZE" in os.environ or env.world_size > 1):
        if "MASTER_PORT" not in os.environ:
            raise HetrainError(f"MASTER_ADDR is set ({os.environ['MASTER_ADDR']}) but MASTER_PORT is not; set both, or "
                               "start the script with `hetrain launch --nproc-per-node N script.py`")
        # Under the elastic agent's shared store, workers keep one store across restarts; keys written
        # by a failed attempt (a dead rank's address) would be read by the next one: namespace them by
        # the restart count (which only nodes that restart together share). Otherwise rank 0 hosts a
        # new store for each attempt (hetrain launch on several nodes), where every node finds it.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=env.world_size,
                              is_master=not agent and env.rank == 0, timeout=timeout)
        attempt = f"/attempt{env.restart_count}" if agent else ""
        # a new session after one closed starts a new group: the closed group's keys (its ranks' addresses,
        # some ranks' gloo connections half made) must not be read by the new one's ranks
        store = dist.PrefixStore(f"hetrain/{env.run_id}{attempt}/group{next(_GROUPS)}", store)
        with _one_rank_prefix():
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        return True, store
    if env.world_size == 1:
        with _one_rank_prefix():
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return True, None
    raise HetrainError(
        f"WORLD_SIZE is {env.world_size} but no rendezvous address is set (MASTER_ADDR and MASTER_PORT); "
        "start the script with `hetrain launch --nproc-per-node N script.py`, or set both"
    )


def configure_logging(level: int | str | None) -> object | None:
    """`[hetrain rank R]` lines; INFO on rank 0, warnings elsewhere, unless a level is given."""
    logger = logging.getLogger("hetrain")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[hetrain rank %(rank)s] %(message)s"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.propagate = False
    if level is not None:   # for this session's life (a sweep's next trial gets the default again)
        if not _LEVELS:
            _LEVELS.append((None, logger.level))   # the level before any session set one
        logger.setLevel(level.upper() if isinstance(level, str) else level)
        token = object()
        _LEVELS.append((token, logger.level))
        return token
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if env_int("RANK", 0) == 0 else logging.WARNING)
    return None


_LEVELS: list[tuple[object, int]] = []   # the levels sessions given log_level set, over the one before them


def restore_logging(token: object | None) -> None:
    """A session given `log_level` closes: the level of the latest one still open comes back, or the level before
    them (sessions may close in any order)."""
    if token is None or not any(t is token for t, _ in _LEVELS):
        return
    _LEVELS[:] = [(t, lvl) for t, lvl in _LEVELS if t is not token]
    logging.getLogger("hetrain").setLevel(_LEVELS[-1][1])
    if len(_LEVELS) == 1:
        _LEVELS.clear()


_ERROR_HINTS: list[Callable[[], Callable[[BaseException], str | None] | None]] = []


def add_error_hint(hint: Callable[[BaseException], str | None]) -> None:
    """`hint(error)` may name a likely cause of an error that ends this rank (a note under its traceback).
    A bound method is held weakly: its object (a loader and its workers) is not kept alive by it."""
    _ERROR_HINTS.append(weakref.WeakMethod(hint) if inspect.ismethod(hint) else (lambda: hint))


def _add_hints(error: BaseException) -> None:
    _ERROR_HINTS[:] = [ref for ref in _ERROR_HINTS if ref() is not None]
    for ref in _ERROR_HINTS:
        hint = ref()
        try:
            note = hint(error) if hint is not None else None
        except Exception:   # a hint never hides the error itself
            note = None
        if note:
            add_note(error, note)


def _open_files() -> list[Any]:
    """Every open file object the script may have written to: interpreter teardown flushes them, os._exit does
    not. (Found before the exit hooks run: hetrain's own freezes the collector, which then lists none.)"""
    import io

    files = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)   # classes, not io.IOBase: its isinstance asks
    return [obj for obj in gc.get_objects() if type(obj) in files]     # every object (torch's warn when asked)


def _flush(files: list[Any]) -> None:
    for obj in files:
        try:
            if not obj.closed and obj.writable():
                obj.flush()
        except Exception:   # a file that cannot be flushed now (a closed pipe) stays as it is
            pass


def print_user_errors_as_one_line() -> None:
    """In a worker, a HetrainError (bad input) ends the rank with one line, on every rank, and exit 2; under
    `hetrain launch`, Ctrl-C's KeyboardInterrupt and a lost peer are one line naming where the script was
    (hetrain.runtime.ending_lines)."""
    previous = sys.excepthook
    if getattr(previous, "_hetrain", False) or getattr(previous, _TORCH_PREFIXED, False):   # (it wraps ours)
        return

    def hook(kind, value, tb):
        from hetrain.runtime.failure_record import record_exception

        if not isinstance(value, HetrainError):
            _add_hints(value)
        record_exception(value)  # tells the launcher why this rank ended, and when
        from hetrain.runtime.ending_lines import ending_line

        line = ending_line(value, tb) if os.environ.get(Env.LAUNCH_ID) and not sys.flags.interactive else None
        if line:   # the launcher's last line says the rest; the exit status is Python's (130 after Ctrl-C)
            sys.__stderr__.write(line + "\n")
            sys.__stderr__.flush()
            return
        if isinstance(value, HetrainError) and (hasattr(sys, "ps1") or sys.flags.interactive):
            sys.__stderr__.write(f"hetrain: error: {value}\n")   # at an interactive prompt: the prompt goes on
            return
        if isinstance(value, HetrainError):
            rank = os.environ.get("RANK")
            where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
            # one write, so the lines of ranks failing together never run into each other; to the real
            # stderr, as torch may redirect sys.stderr
            sys.__stderr__.write(f"hetrain: error{where}: {value}\n")
            sys.__stderr__.flush()
            from hetrain.checkpoint.lease import release_all

            files = _open_files()   # the script's own files keep what it wrote
            peers = os.environ.get("WORLD_SIZE", "1") != "1" or (dist.is_initialized() and dist.get_world_size() > 1)
            if not peers:   # none to block the exit: the script's own atexit work (its run logger's last upload,
                atexit._run_exitfuncs()   # logging's flush) and a background save's commit run as on any error
            release_all()  # os._exit runs no finalizer: give back the checkpoint directory now
            _flush(files)
            os._exit(2)  # skip interpreter teardown: peers may be blocked in collectives
        previous(kind, value, tb)

    hook._hetrain = True
    sys.excepthook = hook


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each line: one replaced for a while (pytest's capture, redirect_stderr) and
    closed since is not kept."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True
