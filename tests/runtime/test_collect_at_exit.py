"""A rank settles at exit, while the interpreter is whole: it collects its unreachable objects and
leaves the interpreter lock to gloo's worker threads for a moment. A finished collective's tensors
freed by a gloo worker once the interpreter is finalizing end a finished rank with SIGABRT."""

import time

import pytest
import torch

from hetrain import exiting
from hetrain.runtime import environment
from hetrain.planning.plan import BalancePlan
from hetrain.runtime.balancer import Balancer
from tests.distributed import run_ranks


def test_collect_at_exit_registers_one_settling_per_process(monkeypatch):
    registered = []
    monkeypatch.setattr(exiting.atexit, "register", registered.append)
    monkeypatch.setattr(exiting, "_registered", set())
    environment.collect_at_exit()
    environment.collect_at_exit()
    assert registered == [environment.settle_at_exit]


def test_settling_collects_and_gives_a_waiting_thread_the_interpreter_lock(monkeypatch):
    """A thread that wants the interpreter lock (as a gloo worker freeing a finished collective's
    tensors does) gets it while the exiting rank settles, not after."""
    import sys
    import threading

    collected, ran = [], []
    monkeypatch.setattr(environment.gc, "collect", lambda: collected.append("collect"))
    monkeypatch.setattr(environment.gc, "freeze", lambda: collected.append("freeze"))
    switch = sys.getswitchinterval()
    sys.setswitchinterval(30.0)   # the main thread keeps the lock unless it lets go of it itself
    try:
        go = threading.Event()
        worker = threading.Thread(target=lambda: go.wait() and ran.append(time.monotonic()))
        worker.start()
        go.set()                  # the worker now waits for the lock only
        environment.settle_at_exit()
        settled = time.monotonic()
    finally:
        sys.setswitchinterval(switch)
    worker.join()
    assert collected == ["collect", "freeze"]   # what is left is frozen: the teardown does not walk it again
    assert ran and ran[0] <= settled


@pytest.fixture
def registered(monkeypatch):
    """What a one-rank session registers at exit, in a process that has registered nothing yet."""
    calls = []
    monkeypatch.setattr(exiting.atexit, "register", calls.append)
    monkeypatch.setattr(exiting, "_registered", set())
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    return calls


def test_a_session_that_starts_the_process_group_settles_at_exit(registered):
    import hetrain

    session = hetrain.Session()
    try:
        assert environment.settle_at_exit in registered
    finally:
        session.close()


def test_a_session_on_a_group_the_script_started_settles_at_exit(registered):
    """A ported DDP script starts its own process group before the session: its ranks are covered too."""
    import torch.distributed as dist

    import hetrain

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        session = hetrain.Session()
        try:
            assert environment.settle_at_exit in registered
        finally:
            session.close()
        assert dist.is_initialized()   # the script's group is left to the script
    finally:
        dist.destroy_process_group()


def _exchange_then_read(rank: int, world: int) -> bool:
    import gc
    import weakref

    import torch.distributed as dist

    dist.init_process_group("gloo")
    given = []
    gather = dist.all_gather

    def watched(out, local, **kw):
        given.extend(weakref.ref(t) for t in [local, *out])
        return gather(out, local, **kw)

    dist.all_gather = watched
    balancer = Balancer(BalancePlan(interval=1), [32, 32], rank=rank)
    balancer.record(32, 0.01)
    balancer.begin_exchange(torch.device("cpu"))
    balancer.arrived()
    gc.collect()
    # the tensors live on in Python after their collective finished: the gloo worker that frees the
    # finished work drops only its own reference to them and never needs the interpreter lock for it
    return len(given) == 1 + world and all(ref() is not None for ref in given)


def test_the_balancer_holds_its_exchange_tensors_past_the_gather():
    assert run_ranks(_exchange_then_read, 2) == [True, True]


_CYCLED_LOADER = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
from hetrain.runtime import environment

class Trainer:   # a trainer whose batches come from a generator method: the iterator sits in a cycle
    def __init__(self):
        self.loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2,
                                 persistent_workers=True)
        self.batches = self._cycle()
    def _cycle(self):
        while True:
            yield from self.loader

trainer = Trainer()
next(trainer.batches)
print(" ".join(str(w.pid) for w in trainer.loader._iterator._workers))   # persistent: the loader keeps it
environment.collect_at_exit()
del trainer
print(time.monotonic(), flush=True)
"""


def test_a_loader_iterator_in_a_cycle_does_not_hold_the_exit_five_seconds_a_worker(tmp_path):
    """The exit's collection ran before torch's exit hook, so a DataLoader iterator in a reference cycle
    joined each of its workers for 5 s before killing it: 10 s of a 2-worker job's exit."""
    import os
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_CYCLED_LOADER)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    ended = time.monotonic()
    assert r.returncode == 0, r.stderr[-2000:]
    pids, last_line = r.stdout.split("\n")[:2]
    assert ended - float(last_line) < 4.0   # 10 s before; the interpreter's own teardown takes under 1 s
    for pid in map(int, pids.split()):   # the workers ended with the process
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
