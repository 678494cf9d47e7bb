"""Run a function on N CPU ranks over gloo, as the launcher would set them up (for tests)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.ports import free_port




def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue, env: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)  # bytes, not shared-memory handles that die with us
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report to the parent, which fails the test with this trace
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT = None


def _context():
    """A forkserver that has imported torch once: each rank forks from it instead of importing anew.
    hetrain imports torch's ZeRO, pipelining and checkpoint modules only when a plan needs them, and
    torch's optimizers import torch._dynamo when the first is built; the tests' ranks use all of
    them, so the forkserver imports them once too."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "hetrain.runtime.session",
                                         "hetrain.runtime.zero1", "hetrain.checkpoint.sharded",
                                         "torch.distributed.pipelining", "torch._dynamo",
                                         "hetrain.bench.digits"])
    return _CONTEXT


def run_ranks(fn: Callable, world: int, *args: Any, env: dict | None = None, timeout: float = 120) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns each rank's return value, by rank."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, env or {})) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) < world:
        if queue.empty():
            _check_alive(procs, results, queue, deadline)
            time.sleep(0.05)
            continue
        rank, status, value = queue.get()
        if status == "error":
            errors.append(f"rank {rank}:\n{value}")
        results[rank] = torch.load(io.BytesIO(value), weights_only=False) if status == "ok" else None
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def _check_alive(procs, results: dict, queue, deadline: float) -> None:
    """Fail (killing every rank) when a rank ended without reporting, or the ranks ran past the deadline."""
    ended = [(r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
    late = time.monotonic() > deadline
    if not ended and not late:
        return
    if ended and not late:
        time.sleep(0.5)          # its report may still be on its way through the pipe
        if not queue.empty():
            return
    for p in procs:
        if p.is_alive():
            p.kill()
    if late:
        raise AssertionError(f"ranks {sorted(set(range(len(procs))) - set(results))} did not report within the timeout")
    raise AssertionError("ranks ended without reporting: " + ", ".join(f"rank {r} exit code {c}" for r, c in ended))


PIPE_GRACE_S = 10.0
"""How long run_cli reads a command's output after the command exited (its own output is complete then)."""

STACK_DUMPS = Path(__file__).resolve().parent / "stack_dumps"
"""On a command's PYTHONPATH: its sitecustomize has every Python process dump its stacks on STACKS_SIGNAL."""
STACKS_SIGNAL = signal.SIGUSR2
STACKS_QUIET_S = 0.5   # a process's dump is taken as whole once its stderr was quiet this long (2 s at most)
MOST_DUMPED = 16       # processes asked for their stacks, at most


class CommandTimedOut(subprocess.TimeoutExpired):
    """run_cli's command ran past its timeout; the message holds the stacks of each of its processes, taken
    before they were killed (pytest shows a TimeoutExpired as the command alone)."""

    def __init__(self, cmd: list[str], timeout: float, output: str, stderr: str, before: str, stacks: str) -> None:
        super().__init__(cmd, timeout, output, stderr)
        self.before, self.stacks = before, stacks

    def __str__(self) -> str:
        return (f"{super().__str__()}\n--- its stderr before it was stopped (tail) ---\n{self.before[-3000:]}"
                f"\n--- where each of its processes was (stacks on {STACKS_SIGNAL.name}) ---\n{self.stacks[-40000:]}")


def with_stack_dumps(env: dict | None) -> dict:
    """`env` (this process's when None) with STACK_DUMPS first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STACK_DUMPS), env.get("PYTHONPATH", "")) if p)
    return env


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (a launcher's workers start sessions of their own: not its group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():   # without /proc: `pid` alone
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(b")") + 2:].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _describe(pid: int) -> tuple[str, bool]:
    """(pid, state, kernel wait and command line, in words; whether it runs Python)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = " ".join(f.read().decode(errors="replace").split())
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
        python = os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
    except OSError:
        return f"pid {pid} (gone)", False
    return f"pid {pid} state {state} wchan {wchan}: {cmdline[:300]}", python


def dump_stacks(pid: int, err: list[str]) -> str:
    """Ask each process of the command rooted at `pid` for its stacks, one at a time, and return them, each
    under its process's line; `err` is the list the command's stderr lines are being read into."""
    out = []
    for p in descendants(pid)[:MOST_DUMPED]:
        said, python = _describe(p)
        start = len(err)
        if python:
            try:
                os.kill(p, STACKS_SIGNAL)
            except ProcessLookupError:
                continue
            deadline, seen, quiet_since = time.monotonic() + 2.0, start, time.monotonic()
            while time.monotonic() < deadline and time.monotonic() - quiet_since < STACKS_QUIET_S:
                time.sleep(0.05)
                if len(err) != seen:
                    seen, quiet_since = len(err), time.monotonic()
        out.append(f"=== {said}\n" + ("".join(err[start:]) if python else "(not a Python process)\n"))
    return "".join(out)


def run_cli(cmd: list[str], *, cwd=None, timeout: float = 300, env: dict | None = None,
            grace: float = PIPE_GRACE_S) -> subprocess.CompletedProcess:
    """Run a command in its own process group and return when it exits. On timeout, each of its processes is
    asked for its stacks (STACK_DUMPS), then all are killed (agent, ranks, their workers), and CommandTimedOut
    says where each was. Its output is read by threads, so a process the command left running with its stdout
    open fails the test within `grace` seconds instead of holding it forever."""
    import threading

    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=with_stack_dumps(env))
    parts: dict[str, list[str]] = {"out": [], "err": []}

    def read(stream, key: str) -> None:
        for line in stream:
            parts[key].append(line)

    readers = [threading.Thread(target=read, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, "err"), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        everyone, before = descendants(proc.pid), "".join(parts["err"])
        stacks = dump_stacks(proc.pid, parts["err"])
        for p in [*everyone, *descendants(proc.pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        _join_all(readers, grace)
        raise CommandTimedOut(cmd, timeout, "".join(parts["out"]), "".join(parts["err"]), before, stacks) from None
    _join_all(readers, grace)
    out, err = "".join(parts["out"]), "".join(parts["err"])
    if any(t.is_alive() for t in readers):
        raise AssertionError(f"{cmd[:4]} exited with {proc.returncode} but a process it started still holds its "
                             f"output open {grace:g} s later (a leftover process); stderr:\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _join_all(threads, seconds: float) -> None:
    """Join every thread within one deadline of `seconds` in all (not `seconds` each)."""
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def sigterm_when(cmd: list[str], ready: str, *, after: float, cwd=None, timeout: float = 90, env=None,
                 sig: int | None = None) -> subprocess.CompletedProcess:
    """Start `cmd` in its own process group, wait for a stdout line holding `ready`, send SIGTERM (or `sig`)
    `after` seconds later and return when it exits (its stdout from then on, its stderr); the whole
    group is killed if the test fails on the way."""
    import signal

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        started = any(ready in line for line in proc.stdout)
        assert started and proc.poll() is None, f"no line with {ready!r}, or the job ended first"
        time.sleep(after)
        proc.send_signal(signal.SIGTERM if sig is None else sig)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def train_steps(session: Any, loader: Any, steps: int, stop_after: int | None, body: Callable[[Any], None]) -> bool:
    """`body(batch)` then `session.step()` until `steps` steps are done. False when it stopped after `stop_after`
    steps, as a crash does: no final save (the background save in flight is waited for)."""
    while session.step_count < steps:
        for batch in loader:
            body(batch)
            session.step()
            if stop_after is not None and session.step_count == stop_after:
                session.checkpoints.checkpointer.wait()
                return False
            if session.step_count >= steps:
                break
    return True


def session_error(rank: int, world: int, env: dict[str, list[str]] | None = None, plans: list | None = None) -> str | None:
    """`hetrain.Session()` on this rank with its own environment variables and plan, as nodes given different
    settings start (`env[name][rank]`, `plans[rank]`): the error it raises, or None."""
    import hetrain

    for name, values in (env or {}).items():
        os.environ[name] = values[rank]
    try:
        hetrain.Session(plans[rank] if plans is not None else None)
    except hetrain.HetrainError as e:
        return str(e)
    return None
