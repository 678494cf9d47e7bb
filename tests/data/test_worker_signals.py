"""A loader's workers leave a scheduler's SIGTERM to their rank, and still end with it.

A scheduler that ends a job signals every process of it; a worker that died of it failed the rank's
next batch before the rank could save (tests/recover/test_sigterm.py has the save). The workers ignore
it, so the rank's exit must end them itself: multiprocessing's own exit (SIGTERM to each, then a join)
would wait on them for ever, at an interpreter's exit and at the end of a process multiprocessing
started (torch.multiprocessing.spawn's ranks, or a rank forked by a process that had made a loader of its
own: a forked child inherits the parent's loaders, not its exit hooks)."""

import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import os, sys, time
import torch
from torch.utils.data import TensorDataset
import hetrain

def main(index=0):
    session = hetrain.Session()
    net = torch.nn.Linear(1, 1)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(TensorDataset(torch.arange(4096.0)), global_batch_size=4, num_workers=2,
                            persistent_workers=True, multiprocessing_context=sys.argv[2] or None)
    batches = iter(loader)
    for _ in range(8):   # every worker has started and served (batches go to the workers in turn)
        next(batches)
    import multiprocessing
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    sys.stdin.readline()   # the test has signalled the workers
    for _ in range(64):    # more than they had read ahead
        next(batches)
    print("read on", flush=True)

def a_loader_tried_then_dropped():
    from torch.utils.data import DataLoader
    from hetrain.runtime.loader_workers import with_sigterm_left_to_rank
    options = with_sigterm_left_to_rank({"num_workers": 1})
    list(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, **options))


if __name__ == "__main__":
    if sys.argv[1] == "spawned":
        import torch.multiprocessing as mp
        mp.spawn(main, nprocs=1)
    elif sys.argv[1] == "forked":   # a rank forked by a process that had made (and dropped) a loader of its own
        import multiprocessing
        a_loader_tried_then_dropped()
        rank = multiprocessing.get_context("fork").Process(target=main)
        rank.start()
        rank.join()
        assert rank.exitcode == 0, rank.exitcode
    else:
        main()
    print("ended", time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("how, context", [("main", ""), ("spawned", ""), ("main", "spawn"), ("forked", "")])
def test_workers_outlive_an_outside_sigterm_and_end_with_their_rank(tmp_path, how, context):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    p = subprocess.Popen([sys.executable, str(script), how, context], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**env, "PYTHONPATH": os.getcwd()})
    try:
        workers = [int(pid) for pid in p.stdout.readline().split()]
        assert len(workers) == 2, p.stderr.read()[-2000:] if p.poll() is not None else workers
        for pid in workers:
            os.kill(pid, signal.SIGTERM)   # from outside the rank, as a scheduler's
        time.sleep(0.5)
        out, err = p.communicate("go\n", timeout=60)   # the exit does not wait on the workers for ever
        assert p.returncode == 0 and "read on" in out, err[-2000:]
        for pid in workers:   # and they ended with the rank
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


STUCK = """
import ctypes, multiprocessing, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from hetrain.runtime.loader_workers import with_sigterm_left_to_rank

class Stuck(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 8:
            ctypes.PyDLL(None).sleep(120)   # a C call that keeps the interpreter lock: no Python thread runs
        return torch.tensor([float(i)])

def own_child(path):   # a child of the script's own: the rank's exit waits for it, as ever
    time.sleep(3)
    open(path, "w").write("done")

if __name__ == "__main__":
    multiprocessing.Process(target=own_child, args=(sys.argv[1],)).start()
    batches = iter(DataLoader(Stuck(), batch_size=4,
                              **with_sigterm_left_to_rank({"num_workers": 1, "persistent_workers": True})))
    next(batches)
    time.sleep(0.5)   # the worker reads ahead, into the stuck call
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
"""


def test_a_worker_stuck_holding_the_interpreter_lock_does_not_hold_up_its_ranks_exit(tmp_path):
    """A worker ends through a thread of its own, which a call holding the interpreter lock starves; the
    rank's exit would wait for that call (multiprocessing joins its children; SIGTERM no longer ends them)."""
    script, done = tmp_path / "stuck.py", tmp_path / "own_child_done"
    script.write_text(STUCK)
    p = subprocess.Popen([sys.executable, str(script), str(done)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        out, err = p.communicate(timeout=60)   # not the 120 s of the stuck call
        assert p.returncode == 0, err[-2000:]
        assert "killed 1 DataLoader worker(s)" in err
        assert done.read_text() == "done"   # the script's own child was left to end by itself
        for pid in [int(pid) for pid in out.split()]:
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _sleep(seconds):
    time.sleep(seconds)


def test_a_process_that_took_a_reaped_workers_pid_is_not_killed_at_the_ranks_exit():
    """Workers of a loader without persistent workers are reaped each epoch; on a long job a process of the
    script's own can get such a pid, and the rank's exit killed it as a stuck worker. A worker is known by its
    pid and its start time."""
    import multiprocessing

    from hetrain.runtime.loader_workers import end_workers_left, start_time

    own = multiprocessing.get_context("fork").Process(target=_sleep, args=(1.5,))
    own.start()
    try:
        started = start_time(own.pid)
        assert started != -1
        assert end_workers_left({(own.pid, started - 1)}, 0.1) == 0   # the pid of a worker gone long ago
        own.join(5)
        assert own.exitcode == 0   # ended by itself, not killed
    finally:
        if own.is_alive():
            own.kill()
    stuck = multiprocessing.get_context("fork").Process(target=_sleep, args=(60,))
    stuck.start()
    chld = signal.getsignal(signal.SIGCHLD)   # reset by the kill (a rank's exit), put back for this test process
    try:
        assert end_workers_left({(stuck.pid, start_time(stuck.pid))}, 0.1) == 1   # the worker itself
    finally:
        signal.signal(signal.SIGCHLD, chld)
    assert stuck.exitcode == -signal.SIGKILL
