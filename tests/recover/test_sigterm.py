"""SIGTERM: every rank saves the same step and stops; a rank stuck in a collective exits promptly."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import _context as rank_context
from tests.distributed import free_port, run_ranks
from tests.memory.models import make_data, make_model


def _session_run(root, name, steps, term_after):
    """One session in `root/name` to `steps`; with term_after, rank 0 sends SIGTERM to rank 1 after that step."""
    import torch.distributed as dist

    import hetrain

    torch.manual_seed(0)
    session = hetrain.Session(balance=False, checkpoint_dir=f"{root}/{name}", checkpoint_interval=5)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    loader = session.loader(make_data(), global_batch_size=8, seed=2)
    start = session.step_count
    pids = [None] * session.world_size
    dist.all_gather_object(pids, os.getpid())
    try:
        while session.step_count < steps:
            for x, y in loader:
                x = x + 0.05 * torch.randn_like(x)
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                if session.step_count == term_after and session.rank == 0:
                    os.kill(pids[1], signal.SIGTERM)   # from outside, as a scheduler or the agent would
                if session.step_count >= steps:
                    break
    except SystemExit as stop:
        return {"start": start, "exit": stop.code, "step": session.step_count}
    session.close()
    return {"start": start, "exit": None, "params": {k: v.clone() for k, v in net.state_dict().items()}}


def _runs(rank, world, root, runs):
    """Several sessions one after another in one process group: [(name, steps, term_after)]."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return [_session_run(root, *run) for run in runs]


def test_sigterm_to_one_rank_saves_the_same_step_on_every_rank_and_a_restart_resumes_there(tmp_path):
    from hetrain.checkpoint.checkpointer import Checkpointer

    straight, stopped = zip(*run_ranks(_runs, 2, str(tmp_path), [("a", 14, None), ("b", 14, 6)]))
    assert [r["exit"] for r in stopped] == [143, 143]
    step = stopped[0]["step"]
    assert stopped[1]["step"] == step and 6 < step <= 8, stopped  # the step in flight, or the next
    latest = Checkpointer(tmp_path / "b").latest()
    assert latest.step == step and latest.world_size == 2

    resumed = [r[0] for r in run_ranks(_runs, 2, str(tmp_path), [("b", 14, None)])]   # a new process: a restart
    assert [r["start"] for r in resumed] == [step, step]
    for k, v in straight[0]["params"].items():
        assert torch.equal(v, resumed[0]["params"][k]), k   # nothing lost, nothing repeated


def _rank_with_grace(rank, world, port, tmp, **env):
    """A rank the session starts itself (so it has a progress watch), SIGTERM's grace 1 s: (session, model,
    loader, every rank's pid)."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HETRAIN_SIGTERM_GRACE": "1", **env})
    torch.set_num_threads(1)
    import torch.distributed as dist

    import hetrain

    session = hetrain.Session(balance=False, checkpoint_dir=f"{tmp}/ckpt", checkpoint_interval=100)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    return session, model, loader, pids


def _stuck(rank, world, port, tmp, how):
    """After step 3 one rank sends SIGTERM to the other and stops answering: it stops itself (SIGSTOP), as a
    node off the network does ("stopped"; "store host stopped": rank 0, which holds the job's store), or
    sleeps with its threads alive ("hung"). The rank signalled blocks in the next collective."""
    session, model, loader, pids = _rank_with_grace(rank, world, port, tmp, HETRAIN_SIGTERM_MAX_WAIT="4")
    sender = 0 if how == "store host stopped" else 1
    if how == "chained":   # the script's own SIGTERM handler, which calls the session's (log, then stop)
        sessions = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda signum, frame: sessions(signum, frame))
    while True:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count == 3 and rank == sender:
                Path(f"{tmp}/sent").write_text(repr(time.time()))
                os.kill(pids[1 - sender], signal.SIGTERM)
                if how == "hung":
                    time.sleep(120)   # alive, its progress watch still speaking, never reaching the step
                os.kill(os.getpid(), signal.SIGSTOP)   # alive, connections open, never answering


@pytest.mark.parametrize("how", ["stopped", "store host stopped", "hung", "chained"])
def test_a_rank_blocked_in_a_collective_exits_soon_after_sigterm(tmp_path, how):
    """The store's host stopped held the signalled rank in its question to the store for gloo's timeout
    (a review); a hung peer whose threads still speak, until the progress timeout; a script's own handler
    that chains to the session's, for ever (a review: the watch heard only the session's own handler)."""
    ctx = rank_context()   # the forkserver run_ranks uses: torch is imported once
    port = free_port()
    procs = [ctx.Process(target=_stuck, args=(r, 2, port, str(tmp_path), how)) for r in range(2)]
    signalled = procs[1 if how == "store host stopped" else 0]
    for p in procs:
        p.start()
    try:
        signalled.join(timeout=60)
        exited = time.time()
        assert not signalled.is_alive(), "the rank signalled stayed blocked after SIGTERM"
        assert signalled.exitcode == 143
        sent = float((tmp_path / "sent").read_text())
        # grace 1 s (HETRAIN_SIGTERM_GRACE), then 3 s to tell a rank gone, or the 4 s cap: not gloo's timeout
        assert exited - sent < 10, exited - sent
        assert not list((tmp_path / "ckpt").glob("step-*"))   # no partial state was passed off as a checkpoint
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _signalled_with_workers(rank, world, root, sig="TERM"):
    """A scheduler that ends a job (SLURM's time limit, scancel) signals every process of it, the ranks'
    DataLoader workers included: here the workers after step 3, each rank after step 8. Slurm's warning
    before the time limit (--signal=USR1@N) is SIGUSR1, whose default action kills at once."""
    import multiprocessing
    import subprocess

    import torch.distributed as dist

    import hetrain

    dist.init_process_group("gloo")
    session = hetrain.Session(balance=False, checkpoint_dir=f"{root}/ckpt", checkpoint_interval=100)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, num_workers=2, persistent_workers=True)
    try:
        while True:
            for x, y in loader:
                session.backward(F.cross_entropy(model(x), y))
                session.step()
                # from another process, as the scheduler's: the workers first, so that the batches they
                # had read ahead are used up before the rank's own signal asks for the save
                if session.step_count == 3:
                    subprocess.run(["kill", f"-{sig}", *[str(w.pid) for w in multiprocessing.active_children()]],
                                   check=True)
                if session.step_count == 8:
                    subprocess.run(["kill", f"-{sig}", str(os.getpid())], check=True)
    except SystemExit as stop:
        return {"exit": stop.code, "step": session.step_count}


@pytest.mark.parametrize("sig", ["TERM", "USR1"])
def test_sigterm_to_every_process_with_loader_workers_saves_the_step_in_flight(tmp_path, sig):
    """The workers died of the signal and the rank's next batch failed ("DataLoader worker ... is killed by
    signal: Terminated"): no save, a traceback per rank (a scheduler audit). The workers leave it to the rank.
    SIGUSR1 killed every process unsaved."""
    from hetrain.checkpoint.checkpointer import Checkpointer

    stopped = run_ranks(_signalled_with_workers, 2, str(tmp_path), sig)
    assert [r["exit"] for r in stopped] == [143, 143], stopped
    saved = Checkpointer(tmp_path / "ckpt").latest()
    assert saved is not None and saved.step == stopped[0]["step"] == stopped[1]["step"] and 8 <= saved.step <= 10


def _exit_codes(target, tmp_path, world=2):
    """Run `target(rank, world, port, tmp)` on `world` ranks the session starts itself; their exit codes
    (None for a rank still running after 60 s, which is then killed)."""
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=60)
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _evaluating(rank, world, port, tmp):
    """After step 3 rank 1 sends SIGTERM to rank 0, then evaluates alone for 4 s (the script's own code):
    rank 0 waits on it in the next step, blocked in a collective, past its 1 s grace."""
    session, model, loader, pids = _rank_with_grace(rank, world, port, tmp)
    while session.step_count < 40:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count == 3 and rank == 1:
                os.kill(pids[0], signal.SIGTERM)
                time.sleep(4)


def test_sigterm_while_a_peer_evaluates_past_the_grace_still_saves(tmp_path):
    """The grace counted from the signal, whatever the ranks were doing: a rank waiting on a peer that
    evaluated (or started its loader's workers) for longer exited unsaved, and the job lost every step since
    its last checkpoint. Now it exits early only when a rank is gone or frozen."""
    from hetrain.checkpoint.checkpointer import Checkpointer

    assert _exit_codes(_evaluating, tmp_path) == [143, 143]
    saved = Checkpointer(tmp_path / "ckpt").latest()
    assert saved is not None and 3 < saved.step <= 5 and saved.world_size == 2


def _closed_then_evaluating(rank, world, port, tmp):
    """After 6 steps rank 1 closes (its final save waits for rank 0); rank 0 gets SIGTERM and evaluates for
    4 s alone before it closes too."""
    session, model, loader, _ = _rank_with_grace(rank, world, port, tmp)
    for x, y in loader:
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if session.step_count >= 6:
            break
    if rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(4)
    session.close()


def test_sigterm_during_a_final_evaluation_while_a_peer_closed_saves_at_close(tmp_path):
    """A closed peer counted as gone: the evaluating rank exited unsaved and the closed one failed in its
    final save (a review). A closed rank waits in its final save; the progress watch names a step it
    never takes."""
    from hetrain.checkpoint.checkpointer import Checkpointer

    assert _exit_codes(_closed_then_evaluating, tmp_path) == [0, 0]
    saved = Checkpointer(tmp_path / "ckpt").latest()
    assert saved is not None and saved.step == 6


WORKERS_SCRIPT = '''
import os
import time
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
import hetrain

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 6, generator=g), torch.randint(0, 3, (4096,), generator=g))
    session = hetrain.Session()
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(data, global_batch_size=16, seed=0, num_workers=2)
    print(f"rank {session.rank} starts at step {session.step_count}", flush=True)
    steps = int(os.environ.get("STEPS", "400"))
    while session.step_count < steps:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            time.sleep(0.02)
            if session.step_count >= steps:
                break
    session.close()
'''


def test_sigterm_to_the_launcher_saves_the_step_in_flight_with_dataloader_workers(tmp_path):
    """The launcher passes SIGTERM to each rank alone, not to its process group: the loader's workers
    keep serving the rank, which saves the step in flight instead of failing on a dead worker, and the
    next launch resumes there."""
    import subprocess
    import sys

    from hetrain.checkpoint.checkpointer import Checkpointer
    from tests.distributed import sigterm_when

    script = tmp_path / "train_workers.py"
    script.write_text(WORKERS_SCRIPT)
    launch = [sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--checkpoint-dir",
              str(tmp_path / "ckpt"), str(script)]
    env = {**os.environ, "HETRAIN_CHECKPOINT_INTERVAL": "100000"}   # only the SIGTERM save
    stopped = sigterm_when(launch, "starts at step 0", after=3, env=env)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "DataLoader worker" not in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.stderr.count("SIGTERM: saving step") == 1, stopped.stderr[-3000:]   # job-wide: said once
    saved = Checkpointer(tmp_path / "ckpt").latest()
    assert saved is not None and saved.step > 0, stopped.stderr[-3000:]
    again = subprocess.run([*launch[:-1], "--max-restarts", "0", str(script)], capture_output=True, text=True,
                           timeout=180, env={**env, "STEPS": "0"})   # where it starts is all this run tells
    assert f"rank 0 starts at step {saved.step}" in again.stdout, again.stderr[-3000:]


def test_a_sigusr1_handler_the_script_sets_after_the_loader_keeps_sigusr1_and_outlives_close(tmp_path):
    """The session took SIGUSR1 at its loader; a handler of the script's own set after it still saw the session
    stop on SIGUSR1 (its watch heard the signal), and close() put SIG_DFL back over it (a later SIGUSR1 killed
    the process)."""
    import hetrain

    got, original = [], signal.getsignal(signal.SIGUSR1)
    session = hetrain.Session(balance=False, checkpoint_dir=str(tmp_path / "ckpt"), async_checkpoints=False)
    net = make_model()
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(make_data(), global_batch_size=8, seed=0)
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
            if session.step_count == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.3)   # the session's watch would have heard it by now
            if session.step_count == 5:
                break
        session.close()
        assert session.step_count == 5 and got == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None)   # still the script's
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_the_launcher_takes_sigusr1_as_sigterm_unless_something_handles_it(monkeypatch):
    """SIGUSR1 (a scheduler's warning before the end: Slurm's --signal=USR1@N) killed the launcher, and with it
    the job, unsaved. The launcher now stops the job as on SIGTERM: SIGTERM to each rank, then exit 143."""
    from torch.distributed.elastic.multiprocessing import SignalException

    from hetrain.launch import graceful_stop

    sent = []
    monkeypatch.setattr(graceful_stop, "rank_pids", lambda launch_id: [12345])
    monkeypatch.setattr(graceful_stop, "_running", lambda pid: False)
    monkeypatch.setattr(graceful_stop.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    original = signal.getsignal(signal.SIGUSR1)
    stop = graceful_stop.GracefulStop("launch-id")
    try:
        assert stop.install() and signal.getsignal(signal.SIGUSR1) == stop.on_sigterm
        with pytest.raises(SignalException) as stopped:
            stop.on_sigterm(signal.SIGUSR1, None)
        assert stopped.value.sigval == signal.SIGTERM and sent == [(12345, signal.SIGTERM)]
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == original
    mine = signal.signal(signal.SIGUSR1, lambda signum, frame: None)   # the script's (or scheduler shell's) own
    try:
        stop = graceful_stop.GracefulStop("launch-id")
        stop.install()
        assert signal.getsignal(signal.SIGUSR1) != stop.on_sigterm
        stop.uninstall()
    finally:
        signal.signal(signal.SIGUSR1, mine)


CLOSED_FROM_A_THREAD = '''
import os
import signal
import sys
import threading
import time

import torch
import hetrain

if __name__ == "__main__":
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    session = hetrain.Session(checkpoint_dir=sys.argv[1])
    net = torch.nn.Linear(8, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, global_batch_size=16):
        session.backward(torch.nn.functional.mse_loss(model(x), y))
        session.step()
    if sys.argv[2] in ("chain", "chain-main"):   # a handler of the script's that passes the signal on to the one
        chained = signal.getsignal(signal.SIGTERM)   # it replaced, where that one is a function

        def handler(signum, frame):
            print("script handler", flush=True)
            if callable(chained):
                chained(signum, frame)
            print("script handler finished", flush=True)

        signal.signal(signal.SIGTERM, handler)
    if sys.argv[2:] == ["not-last-first"]:   # a second session, made after this one and closed before it
        other = hetrain.Session(checkpoint_dir=sys.argv[1] + "2")
        net2 = torch.nn.Linear(8, 1)
        model2, _ = other.prepare(net2, torch.optim.SGD(net2.parameters(), lr=0.1))
        for x, y in other.loader(data, global_batch_size=16):
            other.backward(torch.nn.functional.mse_loss(model2(x), y))
            other.step()
        closing = threading.Thread(target=other.close)
        closing.start()
        closing.join()
        session.close()   # in the main thread; the handler on top is the other session's
    else:
        def close():
            if sys.argv[2:] == ["twice"]:   # a SIGTERM stop gives the signals back, then close() does again
                session.checkpoints._restore_signals()
            session.close()

        if sys.argv[2] == "chain-main":
            close()
        else:
            closing = threading.Thread(target=close)    # a GUI's or a trainer's worker thread ends the run
            closing.start()
            closing.join()
        from hetrain.runtime import resume
        print("sessions waiting for their signals back:", len(resume._CLOSED_ELSEWHERE), flush=True)
    files = [open(os.path.join(sys.argv[1], f"user{i}.bin"), "wb") for i in range(4)]   # the script's own files
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        print("SIGINT was not raised", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
    for f in files:
        f.close()
    print("bytes in the script's files:", sum(os.path.getsize(f.name) for f in files), flush=True)
    if sys.argv[2:] == ["again"]:   # a new session in the main thread takes SIGTERM as usual, and gives it back
        with hetrain.Session(checkpoint_dir=sys.argv[1] + "2") as second:
            net = torch.nn.Linear(8, 1)
            model, _ = second.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for x, y in second.loader(data, global_batch_size=16):
                second.backward(torch.nn.functional.mse_loss(model(x), y))
                second.step()
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        print("second session", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)
    print("still alive after SIGTERM", flush=True)
'''


@pytest.mark.parametrize("how", ["once", "again", "twice", "chain", "chain-main", "not-last-first"])
def test_a_session_closed_from_another_thread_gives_the_signals_back(tmp_path, how):
    """close() from a worker thread could not reset the signal wakeup fd (main thread only) but closed its pipe:
    the next file opened took that fd number, and a Ctrl-C wrote a byte into it; SIGTERM stayed the closed
    session's, which no longer acted on it, and the process lived on."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(CLOSED_FROM_A_THREAD)
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), how],
                       capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": str(root)})
    assert "KeyboardInterrupt" in r.stdout and "bytes in the script's files: 0" in r.stdout, r.stdout + r.stderr[-2000:]
    assert ("second session" in r.stdout) == (how == "again"), r.stdout + r.stderr[-2000:]
    chain = how.startswith("chain")   # the script's handler acts on the signal as if the session had never been:
    if chain:                         # what it replaced was the default, which it does not call, so the process lives
        assert r.returncode == 0 and "still alive" in r.stdout, r.stdout + r.stderr[-2000:]
        assert r.stdout.count("script handler finished") == 1, r.stdout   # once, not again through the session's
    else:
        assert r.returncode == -signal.SIGTERM and "still alive" not in r.stdout, r.stdout + r.stderr[-2000:]
    if how not in ("not-last-first", "chain-main"):
        assert "sessions waiting for their signals back: 1" in r.stdout, r.stdout   # a session closed twice: once


IDLE_AFTER_THE_LOOP = '''
import sys
import time

import torch
import hetrain

if __name__ == "__main__":
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    session = hetrain.Session(checkpoint_dir=sys.argv[1], checkpoint_interval=2)
    net = torch.nn.Linear(8, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, global_batch_size=16):
        session.backward(torch.nn.functional.mse_loss(model(x), y))
        session.step()
        if session.step_count == 3:
            break
    print("evaluating", flush=True)
    time.sleep(60)   # a long evaluation after the loop, before close()
'''


def test_sigterm_during_work_after_the_loop_says_where_the_rank_was(tmp_path):
    """A rank in the script's own code after its last step (an evaluation before close()) was said not to have
    reached the end of its step."""
    import sys

    from tests.distributed import sigterm_when

    script = tmp_path / "job.py"
    script.write_text(IDLE_AFTER_THE_LOOP)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), HETRAIN_SIGTERM_GRACE="0.5",
               HETRAIN_SIGTERM_MAX_WAIT="1")
    r = sigterm_when([sys.executable, str(script), str(tmp_path / "ckpt")], "evaluating", after=0, env=env)
    assert ("SIGTERM: rank 0 was between steps (after step 3: in the script's own code, or reading its next batch) "
            "for") in r.stderr, r.stderr[-2000:]
    assert "did not reach the end of its step" not in r.stderr
