"""A rank dies with its launcher; a stalled rank is named within the timeout; the first failure is named."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetrain.launch.failures import describe, first_failure
from hetrain.runtime.failure_record import read_failure_record, record_exception, record_failure
from hetrain.runtime.watchdog import Progress, find_stall
from tests.distributed import free_port, run_ranks
from tests.faults.jobs import run_job

ROOT = Path(__file__).resolve().parents[2]


def _p(step, phase, seq):
    return Progress(step, phase, 1.0, seq)


def test_the_rank_still_computing_while_the_others_wait_is_the_culprit_and_reports_itself():
    before = {0: _p(5, "waiting", 10), 1: _p(5, "computing", 10), 2: _p(5, "waiting", 10)}
    after = {0: _p(5, "waiting", 13), 1: _p(5, "computing", 13), 2: _p(5, "waiting", 12)}
    stall = find_stall(before, after)
    assert (stall.culprits, stall.step, stall.reporter, stall.silent) == ([1], 5, 1, [])


def test_a_silent_culprit_is_named_by_the_lowest_rank_that_can_speak_at_the_step_the_others_wait_in():
    before = {0: _p(5, "waiting", 10), 1: _p(0, "computing", 1), 2: _p(5, "waiting", 10)}
    after = {0: _p(5, "waiting", 13), 1: _p(0, "computing", 1), 2: _p(5, "waiting", 12)}
    stall = find_stall(before, after)
    assert (stall.culprits, stall.step, stall.reporter, stall.silent) == ([1], 5, 0, [1])
    # a rank that never published is the culprit; one that is behind by a step is too
    assert find_stall({}, {0: _p(3, "waiting", 4), 1: None}).culprits == [1]
    assert find_stall(before, {0: _p(6, "waiting", 20), 1: _p(5, "waiting", 11), 2: _p(6, "waiting", 13)}).culprits == [1]
    # a rank whose watch stopped (its loop ended) is neither silent nor a culprit
    done = find_stall({0: _p(8, "done", 30), 1: _p(7, "computing", 2)}, {0: _p(8, "done", 30), 1: _p(7, "computing", 5)})
    assert (done.culprits, done.silent, done.reporter) == ([1], [], 1)


@pytest.mark.parametrize("fork_can_hang", [True, False])
def test_a_rank_stalled_reading_its_batch_is_told_how_a_worker_forked_from_it_can_hang(monkeypatch, fork_can_hang):
    """On Python before 3.12 a DataLoader worker forked from a rank can deadlock before it runs (python/cpython#112275),
    and the rank waits for its batch until the progress limit: the message named only 'a DataLoader worker or the
    dataset stalled', not the start method that avoids it."""
    from hetrain.runtime import watchdog

    monkeypatch.setattr(watchdog, "FORK_CAN_HANG", fork_can_hang)
    before = {0: _p(3, "waiting", 2), 1: _p(3, watchdog.READING, 2)}
    after = {0: _p(3, "waiting", 4), 1: _p(3, watchdog.READING, 4)}
    message = watchdog.stall_message(find_stall(before, after), after, 300.0, 300.0)
    assert message.startswith("rank 1 made no progress at step 3 for 300 s (reading its batch; rank 0 waits on it")
    assert "a DataLoader worker or the dataset stalled" in message, message
    hint = ("a worker forked from a rank can hang before it runs (python/cpython#112275, fixed in 3.12): "
            'multiprocessing_context="forkserver" in session.loader(...)')
    assert (hint in message) == fork_can_hang, message
    computing = {0: _p(3, "waiting", 4), 1: _p(3, "computing", 4)}   # not reading: no word of workers
    assert "forkserver" not in watchdog.stall_message(find_stall(before, computing), computing, 300.0, 300.0)


def test_a_stall_beside_a_rank_inside_a_collective_call_of_the_session_names_the_call():
    """`if rank == 0: session.model_state_dict()` under FSDP2 left the job to 'rank 0 made no progress
    (computing)', naming neither the call nor that every rank makes it."""
    from hetrain.runtime.watchdog import ProgressWatch, stall_message

    after = {0: _p(4, "in session.model_state_dict()", 9), 1: _p(4, "computing", 9)}
    message = stall_message(find_stall(after, after), after, 16.0, 10.0)
    assert message.startswith("rank 1 made no progress at step 4"), message
    assert "rank 0 waits on it in session.model_state_dict(), a collective call every rank must make" in message, message

    class Store:   # the c10d store's set/get, in memory
        def __init__(self):
            self.values = {}

        def set(self, key, value):
            self.values[key] = value

    watch = ProgressWatch(Store(), 0, 2, 10.0)
    watch.computing(4)
    with watch.inside("evaluate"):
        assert (watch._step, watch._phase) == (4, "in session.evaluate()")
    assert (watch._step, watch._phase) == (4, "computing")


def test_a_rank_that_left_on_an_error_while_the_others_wait_in_a_collective_call_is_named_with_it():
    """A rank that caught its error after close() left the others in session.evaluate(): they were told to look
    for the call inside `if rank == 0:`."""
    from hetrain.runtime.watchdog import stall_message

    after = {0: _p(3, "in session.evaluate()", 9), 1: _p(3, "done: left on an error: KeyError: 'label'", 9)}
    message = stall_message(find_stall(after, after), after, 16.0, 10.0)
    assert message.startswith("rank 1 left the session on an error (KeyError: 'label') while rank 0 wait(s) in "
                              "session.evaluate() for 16 s"), message
    assert "let the error end the script" in message and "if rank == 0" not in message, message
    assert message.count("(") == message.count(")"), message


def test_a_rank_that_closed_before_the_others_step_is_named_as_the_cause():
    """A loop that stops after 7 batches: with micro-batches 3:1 that is step 2 on rank 0 and step 7
    on rank 1; rank 0 closes (publishing step 3) while rank 1 waits in step 3 for it."""
    from hetrain.runtime.watchdog import stall_message

    after = {0: _p(3, "done", 30), 1: _p(3, "waiting", 40)}
    message = stall_message(find_stall(after, after), after, 16.0, 10.0)
    assert message.startswith("rank 0 closed the session after 2 step(s) while rank 1 wait(s) in step 3"), message
    assert "session.step_count" in message
    # a rank that closed after its last step while another still computes that step: the slow one
    slow = {0: _p(8, "done", 30), 1: _p(7, "computing", 5)}
    message = stall_message(find_stall(slow, slow), slow, 16.0, 10.0)
    assert message.startswith("rank 1 made no progress") and "closed the session" not in message, message


def test_a_stream_end_is_the_cause_only_while_its_rank_still_says_so_and_others_wait_past_it():
    """A rank whose stream ended before step 3 is the cause of a wait in step 3, once a later publish
    of its entry still says so (it did not just begin the next pass with the others); not of a wait
    in step 2, the pass's last, which the ended rank took."""
    import json

    from hetrain.runtime.watchdog import CLOSED_KEY, ProgressWatch, ended_early

    ended = "its stream ended after 2 global batch(es) of epoch 0"
    assert ended_early({0: _p(2, "waiting", 5), 1: _p(3, ended, 5)}) is None
    assert ended_early({0: _p(3, "waiting", 5), 1: _p(3, f"done: {ended}", 5)}).startswith(
        "rank 1's stream ended after 2 global batch(es) of epoch 0, while rank 0 wait(s) in step 3")

    class Store:
        def __init__(self):
            self.values = {CLOSED_KEY: "1"}

        def set(self, key, value):
            self.values[key] = value

        def check(self, keys):
            return all(k in self.values for k in keys)

        def get(self, key):
            return self.values[key]

    store, reports = Store(), []
    watch = ProgressWatch(store, 0, 2, 10.0, on_stall=lambda message, stall: reports.append(message))
    watch.waiting(3)
    watch._publish()

    def rank1(seq, phase=ended):
        store.set("hetrain/progress/1", json.dumps({"step": 3, "phase": phase, "seconds": 5.0, "seq": seq}))

    rank1(7)
    assert not watch._closed_early(5.0)            # a first read: rank 1 may have moved on since
    assert not watch._closed_early(6.0) and not reports   # its entry did not move: it may be busy in the next pass
    rank1(8, "computing")                            # it began the next pass: no cause
    assert not watch._closed_early(7.0)
    rank1(9)
    rank1(10)
    assert not watch._closed_early(8.0)
    rank1(11)
    assert watch._closed_early(9.0) and reports[0].startswith("rank 1's stream ended after 2"), reports


def _watched_steps(rank, world, store_port, timeout):
    """3 ranks step with an all-reduce; rank 1 stops at step 5 until its watch reports the stall."""
    import threading

    import torch
    import torch.distributed as dist

    from hetrain.runtime.watchdog import ProgressWatch

    dist.init_process_group("gloo")
    store = dist.TCPStore("127.0.0.1", store_port, world_size=world, is_master=rank == 0)
    reports, reported = [], threading.Event()
    watch = ProgressWatch(store, rank, world, timeout, interval_s=0.25,
                          on_stall=lambda message, stall: (reports.append(message), reported.set()))
    watch.start()
    start = time.monotonic()
    x = torch.ones(1)
    for step in range(1, 9):
        watch.computing(step)
        if rank == 1 and step == 5:
            reported.wait(30)          # "hangs" until its own watch names it
            stalled = time.monotonic() - start
        watch.waiting(step)
        dist.all_reduce(x)
    watch.stop()
    dist.barrier()
    return reports, (stalled if rank == 1 else None)


def test_progress_watch_on_three_ranks_names_the_rank_that_sleeps_once_within_the_timeout():
    results = run_ranks(_watched_steps, 3, free_port(), 2.0, timeout=60)
    assert results[0][0] == [] and results[2][0] == [], results   # one report, from the culprit itself
    [message] = results[1][0]
    assert message.startswith("rank 1 made no progress at step 5 for 2 s (computing; ranks 0,2 wait on it")
    assert 2.0 <= results[1][1] < 4.0, results[1][1]


def _launch_stall(fault: str, timeout: float = 4):
    r = run_job([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "3",
                 "--collective-timeout", str(timeout), "tests/faults/stall_job.py", fault, "1:5"],
                cwd=ROOT, env=dict(os.environ), timeout=120)
    stalled_at = float(re.search(r"at step 5 at ([0-9.]+)", r.stdout).group(1))
    return r, time.time() - stalled_at


@pytest.mark.parametrize("fault, reporter", [("--hang", 1), ("--freeze", 0)])
def test_hetrain_launch_ends_a_job_with_a_stalled_rank_within_the_timeout_naming_it(fault, reporter):
    r, after_stall = _launch_stall(fault)
    assert r.returncode == 2, r.stderr[-3000:]
    reports = [ln for ln in r.stderr.splitlines() if ln.startswith("hetrain: error:")]
    assert len(reports) == 1 and "rank 1 made no progress at step 5 for 4 s" in reports[0], r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("hetrain launch: error: rank 1 made no progress at step 5"), last
    assert f"rank {reporter} reported it and exited with code 124" in last, last
    assert after_stall < 4 + 4, after_stall     # the timeout, a watch interval, the agent's shutdown
    assert not r.left_behind


PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(120)
""")
CHILD = textwrap.dedent("""
    import time
    from hetrain.runtime.parent_death import die_with_parent
    die_with_parent(poll_s=0.2, use_prctl={use_prctl})
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("use_prctl", [True, False])
def test_a_process_that_called_die_with_parent_ends_when_its_parent_is_killed(use_prctl):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD.format(use_prctl=use_prctl)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.5)        # the child has armed its watch
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.time() + 10
        while _alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the child outlived its killed parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _failure(exitcode, timestamp, data=None):
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, error_file_data=data or {"message": "<NONE>"})


def test_the_first_failure_is_the_cause_not_the_peer_that_exited_first(tmp_path, monkeypatch):
    def record(message, **kw):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        record_failure(message, **kw)
        import json
        return json.loads(path.read_text())

    raised = record("RuntimeError: boom")
    try:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    except RuntimeError as e:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "echo.json"))
        record_exception(e)
    echo = __import__("json").loads((tmp_path / "echo.json").read_text())
    assert read_failure_record(echo).secondary and not read_failure_record(raised).secondary
    # rank 1 exited first (its peer's connection closed); rank 0 raised first but was slow to exit
    # and was stopped by the agent: rank 0 is named
    failures = {1: _failure(1, 100, echo), 0: _failure(-15, 100, raised)}
    rank, f = first_failure(failures)
    assert rank == 0 and describe(rank, f) == "rank 0 was killed by SIGTERM: RuntimeError: boom"
    # without records: a rank the agent stopped is not the cause, whatever the clock said
    assert first_failure({0: _failure(-15, 99), 1: _failure(1, 100)})[0] == 1
    # a rank killed outright (no record) is the cause; the peer's record only echoes it
    assert first_failure({0: _failure(1, 100, echo), 1: _failure(-9, 101)})[0] == 1
    assert describe(1, _failure(-9, 101)) == "rank 1 was killed by SIGKILL"
    # an abort has no Python error to show: the line says where gloo's come from (a bare SIGABRT named none)
    aborted = describe(1, _failure(-6, 101))
    assert aborted.startswith("rank 1 was killed by SIGABRT (an abort in C++; under gloo, ranks calling different "
                              "collectives: a collective of the script's own that one rank alone calls"), aborted
    assert "session.gather_rows" in aborted and "FSDP2" in aborted


def test_a_stall_report_goes_before_a_peer_killed_by_a_signal_in_the_same_second(tmp_path, monkeypatch):
    """Rank 1 reports its own stall at 100.7 s and exits 124; rank 0, waiting on it, dies by SIGABRT
    at 100.9 s with no record, which the agent stamps as second 100: the report is the first failure."""
    import json

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "stall.json"))
    monkeypatch.setattr(time, "time", lambda: 100.7)
    record_failure("rank 1 made no progress at step 5 for 4 s", blame=1)
    stall = json.loads((tmp_path / "stall.json").read_text())
    assert read_failure_record(stall).time == 100.7
    rank, failure = first_failure({0: _failure(-6, 100), 1: _failure(124, 100, stall)})
    assert rank == 1 and describe(rank, failure).startswith("rank 1 made no progress at step 5"), describe(rank, failure)
    # a bare death a whole second earlier still goes first
    assert first_failure({0: _failure(-6, 99), 1: _failure(124, 100, stall)})[0] == 0


def test_a_failure_is_summed_up_as_its_whole_first_paragraph_without_torchs_frames():
    from hetrain.runtime.failure_record import one_line

    wrapped = RuntimeError("An attempt has been made to start a new process before the\n"
                           "        current process has finished its bootstrapping phase.\n\n"
                           "        This probably means that you are not using fork to start your")
    assert one_line(wrapped) == ("RuntimeError: An attempt has been made to start a new process before the current "
                                 "process has finished its bootstrapping phase.")
    framed = RuntimeError("Connection closed by peer [127.0.0.1]:1234\n"
                          "Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:672\n"
                          "frame #0: c10::Error::Error(...) + 0x96")
    assert one_line(framed) == "RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    assert len(one_line(ValueError("x" * 1000))) == 300 and one_line(KeyError()) == "KeyError"
    words = one_line(ValueError("see docs/pipeline.md " * 30))   # cut between words, not in "docs/pipe..."
    assert len(words) <= 300 and words.endswith(" ...") and set(words.split()[1:-1]) == {"see", "docs/pipeline.md"}
    from hetrain.errors import HetrainError

    long = "a refusal of hetrain's own, whose fix comes at the end: " + "x " * 150 + "pass --the-flag"
    assert one_line(HetrainError(long)) == f"HetrainError: {long}"   # one line already: never cut


EARLY_CLOSE_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
import hetrain

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 6, generator=g), torch.randint(0, 3, (256,), generator=g))
    session = hetrain.Session()
    net = torch.nn.Linear(6, 3)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for i, (x, y) in enumerate(session.loader(data, global_batch_size=16, seed=0)):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if i + 1 == 7:        # seven batches: step 2 on rank 0 (3 micro-batches a step), step 7 on rank 1
            break
    session.close()
'''


def _launch_with_plan(tmp_path, plan, script: str):
    """`hetrain launch` of `script` on 2 ranks with `plan`: the result, and the seconds it took."""
    from tests.distributed import run_cli

    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "job.py").write_text(script)
    start = time.monotonic()
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--plan",
                 str(tmp_path / "plan.json"), str(tmp_path / "job.py")], cwd=ROOT, timeout=120)
    return r, time.monotonic() - start


def test_a_rank_that_closes_early_is_named_in_seconds_not_after_the_progress_timeout(tmp_path):
    """Stopping after a count of batches, ranks with 3 and 1 micro-batches a step stop at steps 2 and
    7: rank 1 waits in step 3 for a rank that closed. It is named within seconds of the close, not
    after the 300 s progress timeout."""
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=16, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=12, micro_batch=4), RankPlan(rank=1, share=4)])
    r, took = _launch_with_plan(tmp_path, plan, EARLY_CLOSE_SCRIPT)
    assert r.returncode != 0 and took < 60, r.stderr[-2000:]
    assert "rank 0 closed the session after 2 step(s) while rank 1 wait(s) in step 3" in r.stderr, r.stderr[-2000:]


CAUGHT_ERROR_SCRIPT = '''
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
import hetrain

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 6, generator=g), torch.randint(0, 3, (256,), generator=g))
    try:
        with hetrain.Session() as session:
            net = torch.nn.Linear(6, 3)
            model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            for x, y in session.loader(data, global_batch_size=16, seed=0):
                if session.rank == 1 and session.step_count == 2:
                    raise ValueError("a bad batch on rank 1")
                session.backward(F.cross_entropy(model(x), y))
                session.step()
    except ValueError as e:          # logged, and the script goes on to its other work
        print("caught:", e, flush=True)
        time.sleep(60)
'''


def test_a_rank_that_caught_its_error_is_named_with_the_error_not_as_a_closed_loop(tmp_path):
    """Rank 1 raised in its third step inside `with Session()` and the script caught the error: rank 0, waiting
    in step 3, was told that rank 1 closed the session and to end its loop on step_count, which it does."""
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=16, balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=0, share=8), RankPlan(rank=1, share=8)])
    r, took = _launch_with_plan(tmp_path, plan, CAUGHT_ERROR_SCRIPT)
    assert r.returncode != 0 and took < 60, r.stderr[-2000:]
    assert ("rank 1 left the session on an error (ValueError: a bad batch on rank 1) after 2 step(s), while rank 0 "
            "wait(s) in step 3") in r.stderr, r.stderr[-2000:]
    assert "let the error end the script" in r.stderr and "step_count" not in r.stderr, r.stderr[-2000:]


SKIP_EMPTY_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import hetrain

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    session = hetrain.Session()
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, global_batch_size=8, shuffle=False):
        if len(x) == 0:   # this rank's share is 0: skipped, with no backward and no step
            continue
        session.backward(F.mse_loss(model(x), y))
        session.step()
    session.close()
'''


def test_a_rank_that_skips_its_empty_batches_is_named_in_seconds(tmp_path):
    """A rank whose share is 0 `continue`d past its batches and closed; rank 0 waited in its first step's
    collective, published as computing, and after the 300 s limit was itself named ('rank 0 made no
    progress at step 1 (computing; rank 1 waits on it')."""
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False, min_share=0),
                ranks=[RankPlan(rank=0, share=8), RankPlan(rank=1, share=0)])
    r, took = _launch_with_plan(tmp_path, plan, SKIP_EMPTY_SCRIPT)
    assert r.returncode != 0 and took < 60, r.stderr[-2000:]
    assert "rank 1 closed the session after 0 step(s) while rank 0 wait(s) in step 1" in r.stderr, r.stderr[-2000:]
    assert "an empty one too" in r.stderr


BREAK_AT_THE_TOP_SCRIPT = '''
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import hetrain

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    session = hetrain.Session()
    net = torch.nn.Linear(4, 1)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, global_batch_size=8, shuffle=False):
        if session.step_count >= 3:   # checked after the next batch is drawn
            break
        session.backward(F.mse_loss(model(x), y))
        session.step()
    if session.rank == 1:
        time.sleep(6)   # an evaluation or export on this rank alone, longer than the early-close check's wait
    session.close()
    print(f"rank {session.rank} closed", flush=True)
'''


def test_a_loop_that_breaks_after_drawing_a_batch_then_works_on_one_rank_is_not_called_an_early_close(tmp_path):
    """The drawn batch left rank 1 'computing' step 4, and rank 0's close made it end the job as waiting in a
    step rank 0 never took (the early-close check counted computing ranks since they wait in their first
    step's collectives: a rank that skips its empty batches)."""
    from hetrain.planning.plan import BalancePlan, Plan, RankPlan

    plan = Plan(global_batch_size=8, balance=BalancePlan(enabled=False), ranks=[RankPlan(rank=r, share=4) for r in range(2)])
    r, _ = _launch_with_plan(tmp_path, plan, BREAK_AT_THE_TOP_SCRIPT)
    assert r.returncode == 0 and "rank 0 closed" in r.stdout and "rank 1 closed" in r.stdout, r.stderr[-2000:]


def test_a_node_whose_ranks_only_lost_their_peers_says_the_failure_began_on_another_node(tmp_path, monkeypatch):
    import json

    from hetrain.launch.launcher import LaunchConfig, failure_line

    try:
        raise RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:1234")
    except RuntimeError as e:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "echo.json"))
        record_exception(e)
    echo = json.loads((tmp_path / "echo.json").read_text())
    line = failure_line({0: _failure(1, 100, echo), 1: _failure(1, 100, echo)}, LaunchConfig(script="t.py", nnodes="2"))
    assert line.startswith("every rank on this node lost its peers (rank 0 exited with code 1: RuntimeError: "), line
    assert "Connection closed by peer" in line and "): the failure began on another node" in line, line
    # on one node there is no other node to blame
    assert failure_line({0: _failure(1, 100, echo)}, LaunchConfig(script="t.py")).startswith("rank 0 exited with")
    # one node: a rank that ended with exit code 0 while the others only lost it is named (rank 0 was blamed)
    line = failure_line({0: _failure(1, 100, echo)}, LaunchConfig(script="t.py", nproc_per_node=2))
    assert line.startswith("rank 1 ended with exit code 0 while the others were in a step (rank 0 exited"), line
    assert "returns on some ranks only" in line and "session.close()" in line, line
    # every rank saved and stopped (exit 143) on a SIGTERM one worker received: not "rank 0 exited with code 143"
    line = failure_line({0: _failure(143, 100), 1: _failure(143, 100)}, LaunchConfig(script="t.py", nproc_per_node=2))
    assert line.startswith("every rank stopped on a SIGTERM a worker received (not this launcher)"), line
    assert "run the same command again to resume" in line, line
    # one node: a rank killed by a SIGTERM no failure came before (a kill from outside) is named, not the others
    line = failure_line({1: _failure(-15, 100)}, LaunchConfig(script="t.py", nproc_per_node=2))
    assert line.startswith("rank 1 was killed by SIGTERM from outside the job (no rank had failed before it"), line
    # ... and where the agent then stopped the other rank with SIGTERM too (as torch records it), neither is blamed
    line = failure_line({0: _failure(-15, 100), 1: _failure(-15, 100)}, LaunchConfig(script="t.py", nproc_per_node=2))
    assert line.startswith("ranks 0,1 were killed by SIGTERM, the first of them from outside the job"), line
    # where its output is when the console does not show it
    line = failure_line({1: _failure(1, 100)}, LaunchConfig(script="t.py", nproc_per_node=2, local_ranks_filter="0"))
    assert line.endswith("its output is not on the console (--local-ranks-filter 0)"), line
    line = failure_line({1: _failure(1, 100)}, LaunchConfig(script="t.py", nproc_per_node=2, redirects="3"))
    assert line.endswith("its output went to the agent's files in a temporary folder (--redirects without "
                         "--log-dir)"), line
    for redirects in ("0", "1:3", "1"):   # none, another rank's, its stdout only: its error is on the console
        cfg = LaunchConfig(script="t.py", nproc_per_node=2, redirects=redirects, log_dir="L")
        assert failure_line({0: _failure(1, 100)}, cfg).endswith("its output is above and in L"), redirects
    # a rank of this node that failed by itself is named as before
    line = failure_line({0: _failure(1, 100, echo), 1: _failure(-9, 100)}, LaunchConfig(script="t.py", nnodes="2"))
    assert line.startswith("rank 1 was killed by SIGKILL; the job ended"), line
    # a SIGKILL's usual sender is said; another signal's line has no such words
    assert line.endswith("; a SIGKILL no one sent is most often the kernel's, when the host runs out of memory "
                         "(`dmesg` names the process it killed)"), line
    assert "out of memory" not in failure_line({1: _failure(-11, 100)}, LaunchConfig(script="t.py", nproc_per_node=2))


SHORT_STREAM_SCRIPT = '''
import os
import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset
import hetrain


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(self.n):
            yield torch.randn(6, generator=g), i % 3


if __name__ == "__main__":
    short = int(os.environ["RANK"]) == 1         # a bug: rank 1's stream is two global batches short
    session = hetrain.Session()
    net = torch.nn.Linear(6, 3)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = session.loader(Stream(64 - 32 * short), global_batch_size=16)
    while loader.epoch < 2:
        for x, y in loader:
            session.backward(F.cross_entropy(model(x), y))
            session.step()
    session.close()
'''


def test_a_stream_that_ends_early_on_one_rank_is_named_in_seconds_not_after_the_progress_timeout(tmp_path):
    """Rank 1's stream ends after 2 of 4 global batches while rank 0 waits in step 3 for it: the job
    ends within seconds naming the rank whose stream ended and what every rank's stream must be."""
    from tests.distributed import run_cli

    (tmp_path / "short.py").write_text(SHORT_STREAM_SCRIPT)
    start = time.monotonic()
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2",
                 str(tmp_path / "short.py")], cwd=ROOT, timeout=120)
    assert r.returncode != 0 and time.monotonic() - start < 60, r.stderr[-2000:]
    assert ("rank 1's stream ended after 2 global batch(es) of epoch 0, while rank 0 wait(s) in step 3 for more"
            in r.stderr), r.stderr[-2000:]
    assert "same samples in the same order" in r.stderr


BARRIER_SCRIPT = '''
import os
import sys
import time
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
import hetrain

if __name__ == "__main__":
    session = hetrain.Session()
    if session.rank == 0:
        time.sleep(float(sys.argv[1]))   # rank 0 alone downloads the dataset; the others wait at the barrier
    if session.rank == 0 or sys.argv[2] == "every-rank":
        session.barrier()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    net = torch.nn.Linear(6, 3)
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(data, global_batch_size=16):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
    if session.is_main:
        print(f"trained {session.step_count}", flush=True)   # one write: two ranks never run together
    session.close()
'''


def test_ranks_wait_at_session_barrier_for_work_one_rank_does_alone_past_the_progress_limit(tmp_path):
    """Rank 0 downloads for 12 s with a 4 s progress limit (and a process-group timeout of 34 s), the other
    waits in session.barrier(): the job was ended as 'ranks 0,1 made no progress at step 0'. It trains on."""
    from tests.distributed import run_cli

    (tmp_path / "barrier.py").write_text(BARRIER_SCRIPT)
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--collective-timeout",
                 "4", str(tmp_path / "barrier.py"), "12", "every-rank"], cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "trained 4" in r.stdout, r.stderr[-2000:]


def test_a_barrier_one_rank_calls_alone_is_named_within_the_progress_limit(tmp_path):
    from tests.distributed import run_cli

    (tmp_path / "barrier.py").write_text(BARRIER_SCRIPT)
    start = time.monotonic()
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--collective-timeout",
                 "4", str(tmp_path / "barrier.py"), "0", "rank-0"], cwd=ROOT, timeout=120)
    assert r.returncode != 0 and time.monotonic() - start < 60, r.stderr[-2000:]
    assert ("the ranks wait in different collective calls at step 0" in r.stderr and "rank 0 in session.barrier(); "
            "rank 1 in session.prepare()" in r.stderr), r.stderr[-2000:]


def test_a_session_barrier_one_rank_calls_while_the_other_waits_in_its_step_is_named_as_such():
    """`if rank == 0: session.barrier()` after a step: 'ranks 0,1 made no progress at step 6 (in
    session.barrier())', as if both waited in the barrier, with no word of the branch."""
    from hetrain.runtime.watchdog import BARRIER, stall_message

    before = {0: _p(6, BARRIER, 9), 1: _p(6, "waiting", 9)}
    after = {0: _p(6, BARRIER, 12), 1: _p(6, "waiting", 12)}
    message = stall_message(find_stall(before, after), after, 16.0, 15.0)
    assert message.startswith("rank 0 wait(s) in session.barrier() while rank 1 wait(s) in step 6 for 16 s"), message
    assert "inside `if rank == 0:`" in message
    frozen = {0: _p(6, BARRIER, 12), 1: _p(6, "waiting", 9)}   # a rank that stopped speaking: not the branch
    assert "wait(s) in step" not in stall_message(find_stall(before, frozen), frozen, 16.0, 15.0)


def test_a_rank_in_its_own_code_between_steps_is_the_culprit_before_one_whose_forward_waits_on_it():
    """Under FSDP2 a rank's forward gathers from the others: rank 0 evaluating alone after step 3 left both
    ranks 'computing' at step 4, and the job was ended as 'ranks 0,1 made no progress'."""
    from hetrain.runtime.watchdog import BETWEEN, stall_message

    before = {0: _p(4, BETWEEN, 9), 1: _p(4, "computing", 9)}
    after = {0: _p(4, BETWEEN, 12), 1: _p(4, "computing", 12)}
    stall = find_stall(before, after)
    assert stall.culprits == [0] and stall.reporter == 0
    message = stall_message(stall, after, 16.0, 10.0)
    assert message.startswith("rank 0 made no progress at step 4 for 16 s (in the script's own code between steps; "
                              "rank 1 waits on it"), message
    assert "an evaluation, a save or a download on this rank alone?" in message


ALONE_SCRIPT = '''
import os
import sys
import time
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
import hetrain
from hetrain.planning.plan import BalancePlan, Plan, RankPlan


class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if sys.argv[1] == "stalled-read" and os.environ["RANK"] == "1" and i >= 32:
            time.sleep(60)      # a dataset that stalls on one rank (a network mount)
        g = torch.Generator().manual_seed(i)
        return torch.randn(6, generator=g), i % 3


if __name__ == "__main__":
    plan = Plan(global_batch_size=16, sharding=sys.argv[2], balance=BalancePlan(enabled=False),
                ranks=[RankPlan(rank=r, share=8) for r in range(2)])
    session = hetrain.Session(plan)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model, _ = session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in session.loader(Slow(), global_batch_size=16, shuffle=False):
        session.backward(F.cross_entropy(model(x), y))
        session.step()
        if sys.argv[1] == "state-dict-alone" and session.is_main and session.step_count == 2:
            session.model_state_dict()   # collective: every rank calls it
    session.close()
'''


@pytest.mark.parametrize("mode, sharding, words", [
    ("state-dict-alone", "fsdp", "rank 1 made no progress at step 3 for {} s (computing; rank 0 waits on it in "
                                 "session.model_state_dict(), a collective call every rank must make"),
    ("stalled-read", "none", "rank 1 made no progress at step 3 for {} s (reading its batch; rank 0 waits on it"),
])
def test_what_one_rank_does_alone_is_named(tmp_path, mode, sharding, words):
    """Rank 0 alone gathering FSDP2 shards (`if rank == 0: session.model_state_dict()`) paired its gathers with
    rank 1's step and gloo aborted the job (SIGABRT, 'Received data size doesn't match'); a dataset stalled on
    one rank was 'computing'."""
    from tests.distributed import run_cli

    (tmp_path / "alone.py").write_text(ALONE_SCRIPT)
    r = run_cli([sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2", "--collective-timeout",
                 "5", str(tmp_path / "alone.py"), mode, sharding], cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "SIGABRT" not in r.stderr, r.stderr[-2000:]
    said = re.search(words.replace("(", r"\(").replace(")", r"\)").replace("{}", "[0-9]+"), r.stderr)
    assert said, r.stderr[-2000:]


def test_ranks_at_a_barrier_wait_for_a_rank_between_epochs_but_not_for_one_that_stopped_speaking():
    """A stream's rank evaluates after its pass ended while the other waits in session.barrier(): a healthy job
    the watch ended as 'ranks 0,1 made no progress'. A rank frozen before the barrier (its watch silent) is
    still named; the barrier has no limit of its own."""
    from hetrain.runtime.watchdog import BARRIER, waits_on_work_before_a_barrier

    ended = "its stream ended after 2 global batch(es) of epoch 0"
    before = {0: _p(3, ended, 9), 1: _p(3, BARRIER, 9)}
    after = {0: _p(3, ended, 12), 1: _p(3, BARRIER, 12)}
    stall = find_stall(before, after)
    assert stall.culprits == [0] and waits_on_work_before_a_barrier(stall, after)
    frozen = {0: _p(3, "computing", 9), 1: _p(3, BARRIER, 12)}
    stall = find_stall({0: _p(3, "computing", 9), 1: _p(3, BARRIER, 9)}, frozen)
    assert stall.silent == [0] and not waits_on_work_before_a_barrier(stall, frozen)


def test_a_second_session_of_the_process_meets_at_barriers_through_the_running_watch(monkeypatch):
    """A GAN's second session has no watch of its own (the process group was there): its barrier() was the
    process group's, with the progress limit, and a download before it ended the job."""
    from hetrain.runtime import meeting, watchdog

    class Store:
        def __init__(self):
            self.values = {}

        def add(self, key, n):
            self.values[key] = self.values.get(key, 0) + n
            return self.values[key]

        def set(self, key, value):
            self.values[key] = value

        def check(self, keys):
            return all(k in self.values for k in keys)

    watch = watchdog.ProgressWatch(Store(), 0, 1, 10.0)
    monkeypatch.setattr(watchdog.ProgressWatch, "current", watch)
    monkeypatch.setattr(meeting, "_meetings", {})
    meeting.meet(None)
    assert watch.store.values == {"hetrain/meet/barrier/1": 1, "hetrain/meet/barrier/1/all": "1"}


def test_ranks_at_a_barrier_do_not_wait_for_a_rank_reading_its_batch_or_in_a_step():
    """A dataset stalled on one rank ('reading its batch') while the other waited in session.barrier() was taken
    for work before the barrier: the job hung without end. A rank in a step (an FSDP2 forward waiting on the
    one at the barrier) or in an uninstrumented collective likewise waited for the process group's timeout."""
    from hetrain.runtime.watchdog import BARRIER, BETWEEN, READING, waits_on_work_before_a_barrier

    for phase, excused in ((READING, False), ("computing", False), (BETWEEN, True)):
        before = {0: _p(3, BARRIER, 9), 1: _p(3, phase, 9)}
        after = {0: _p(3, BARRIER, 12), 1: _p(3, phase, 12)}
        stall = find_stall(before, after)
        assert stall.culprits == [1] and waits_on_work_before_a_barrier(stall, after) is excused, phase


def test_a_session_without_a_watch_tells_the_running_one_at_its_step(monkeypatch):
    """A GAN's second session (made once the process group was there) has no watch: its step left the first
    one's phase at 'waiting' (set by the backward through the first one's model), and a rank's own work after
    it was a stall of every rank; a session trained alone after the first published nothing at all."""
    from hetrain.runtime import meeting, watchdog
    from hetrain.runtime.watchdog import BETWEEN, READING

    watch = watchdog.ProgressWatch(object(), 0, 2, 10.0)
    monkeypatch.setattr(watchdog.ProgressWatch, "current", watch)
    watch.waiting(7)
    meeting.after_step(None, 3)          # the second session's step 3: the running watch stays at its step 7
    assert (watch.step, watch._phase) == (7, BETWEEN)
    loader = SimpleNamespace()
    meeting.watch_loader(loader, None, lambda: 4)
    loader.on_phase("reading")
    assert (watch.step, watch._phase) == (7, READING)


def test_a_collective_call_one_rank_makes_after_the_others_closed_says_so():
    """`if session.is_main: session.model_state_dict()` before close() on every rank: 'ranks 0,1 made no
    progress (in session.model_state_dict())', without a word of rank 1 having closed."""
    from hetrain.runtime.watchdog import stall_message

    before = {0: _p(9, "in session.model_state_dict()", 3), 1: _p(9, "done", 7)}
    after = {0: _p(9, "in session.model_state_dict()", 6), 1: _p(9, "done", 7)}
    message = stall_message(find_stall(before, after), after, 6.0, 5.0)
    assert message.startswith("rank 1 closed the session while rank 0 wait(s) in session.model_state_dict() for 6 s: "
                              "a collective call every rank makes before close()"), message
