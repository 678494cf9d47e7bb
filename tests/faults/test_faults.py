"""Faults injected into a real job under `hetrain launch`, each outcome classified.

An outcome is one of: survived with nothing lost (a restarted job ends with the same parameters as
an uninterrupted one), completed (the job went on past the fault, its parameters finite), ended
with a report (a non-zero exit whose last line names the rank, and the step where one is known,
within the collective timeout), or a hang (the test fails at HANG_S).
"""

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hetrain.vocabulary import Env
from tests.faults.conftest import count
from tests.faults.jobs import Job, run_job

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
TIMEOUT_S = 8       # --collective-timeout
HANG_S = 60         # a job still running after this long hangs
INTERVAL = 4        # steps between checkpoints


def launch(ckpt: Path, faults: str, *, restarts: int = 0, steps: int = STEPS, step_sleep: float = 0.0) -> Job:
    env = {**os.environ, "HETRAIN_TEST_FAULTS": faults, Env.CHECKPOINT_INTERVAL: str(INTERVAL)}
    cmd = [sys.executable, "-m", "hetrain.cli.main", "launch", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "--checkpoint-dir", str(ckpt), "--collective-timeout", str(TIMEOUT_S),
           "tests/faults/train_faults.py", "--steps", str(steps), "--step-sleep", str(step_sleep)]
    return run_job(cmd, cwd=ROOT, env=env, timeout=HANG_S)


def final(stdout: str) -> dict | None:
    m = re.search(r"final step (\d+) finite (True|False) digest (\w+)", stdout)
    return m and {"step": int(m.group(1)), "finite": m.group(2) == "True", "digest": m.group(3)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    r = launch(tmp_path_factory.mktemp("straight") / "ckpt", "")
    assert r.returncode == 0, r.stderr[-3000:]
    return final(r.stdout)["digest"]


def classify(r: Job, baseline: str) -> str:
    done = final(r.stdout)
    if r.returncode == 0 and done is not None and done["step"] == STEPS:
        if done["digest"] == baseline:
            return "survived, nothing lost"
        return "completed" if done["finite"] else "completed with non-finite parameters"
    last = (r.stderr.strip().splitlines() or [""])[-1]
    return "ended with report" if last.startswith("hetrain launch: error: ") else f"ended without report (exit {r.returncode})"


# (faults, --max-restarts, expected outcome, what the report's last line must say)
CASES = [
    ("nan@1:5", 0, "completed", None),
    ("inf@0:5", 0, "completed", None),
    ("raise@0:7", 1, "survived, nothing lost", None),
    ("exit@1:6", 1, "survived, nothing lost", None),
    ("kill@1:6", 1, "survived, nothing lost", None),
    ("killckpt@0:8", 1, "survived, nothing lost", None),
    ("raise@1:7", 0, "ended with report", r"rank 1 (exited with code \d+|was killed by \w+): RuntimeError: injected fault on rank 1 at step 7"),
    ("exit@1:6", 0, "ended with report", r"rank 1 exited with code 3"),
    ("kill@1:6", 0, "ended with report", r"rank 1 was killed by SIGKILL"),
    ("hang@1:5", 1, "survived, nothing lost", None),
    ("raiseslow@0:7", 0, "ended with report", r"rank 0 .*: RuntimeError: injected fault on rank 0 at step 7"),
    ("hang@1:5", 0, "ended with report", r"rank 1 made no progress at step 5 for \d+ s"),
]
IDS = [f"{c[0]}-restarts{c[1]}" for c in CASES]

WAITING = {"hang@1:5-restarts1", "raiseslow@0:7-restarts0", "hang@1:5-restarts0"}
"""Cases whose jobs mostly wait (for the collective timeout, or a slow teardown): they run one at a
time beside the other cases, started when the first case runs, and are checked last."""


@pytest.fixture(scope="module")
def waiting_jobs(request, tmp_path_factory):
    """The selected WAITING cases' jobs, started in the background: id -> Future of their Job."""
    selected = {item.callspec.id for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")} & WAITING
    pool = ThreadPoolExecutor(max_workers=1)
    futures = {}
    for (faults, restarts, *_), case_id in zip(CASES, IDS):
        if case_id in selected:
            futures[case_id] = pool.submit(launch, tmp_path_factory.mktemp("waiting") / "ckpt", faults,
                                           restarts=restarts)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("faults, restarts, expected, report", CASES, ids=IDS)
def test_fault(request, tmp_path, uninterrupted, waiting_jobs, faults, restarts, expected, report):
    count("faults injected")
    case_id = request.node.callspec.id
    try:
        if case_id in waiting_jobs:
            r = waiting_jobs[case_id].result()
        else:
            r = launch(tmp_path / "ckpt", faults, restarts=restarts)
    except subprocess.TimeoutExpired:
        count("hangs")
        pytest.fail(f"{faults}: the job still ran after {HANG_S} s")
    outcome = classify(r, uninterrupted)
    if outcome in ("survived, nothing lost", "ended with report"):
        count(outcome)
    assert outcome == expected, (outcome, r.stderr[-3000:])
    assert not r.left_behind, f"processes {r.left_behind} outlived the job"
    if restarts and expected == "survived, nothing lost":
        fault_step = int(re.search(r":(\d+)$", faults).group(1))
        resumed = [int(s) for s in re.findall(r"rank \d+ starts at step (\d+)", r.stdout)]
        assert max(resumed) == (fault_step - 1) // INTERVAL * INTERVAL > 0, f"the restart resumed from {resumed}, not the checkpoint"
        # the agent says its restart only at INFO: the ranks' start-up lines came again with no word why
        # it names the rank that failed and how: by its own record (an error, a stall report), by the agent's
        # report (a signal, an exit code of the script's), or as the one rank that left no record beside peers that
        # only lost their connection (where the agent, to the second, reported such a peer first)
        said = [line for line in r.stderr.splitlines() if "; starting every rank again" in line]
        silent = r"ended with no error of its own, and every other rank only lost its connection to it \(.*\)"
        who = {"raise@0:7": r"rank 0 failed: RuntimeError: injected fault on rank 0 at step 7 \(its output is above\)",
               "exit@1:6": rf"rank 1 (exited with code 3 \(its output is above\)|{silent})",
               "kill@1:6": rf"rank 1 (was killed by SIGKILL; a SIGKILL no one sent is most often the kernel's.*|{silent})",
               "killckpt@0:8": rf"rank 0 (was killed by SIGKILL; a SIGKILL no one sent .*|{silent})",
               "hang@1:5": r"rank 1 made no progress at step 5 .*?(; rank 0 reported it)? \(its output is above\)"}[faults]
        assert len(said) == 1 and re.fullmatch(rf"hetrain launch: {who}; starting every rank again, restart 1 of 1 "
                                               r"\(--max-restarts\)", said[0]), r.stderr[-3000:]
    if report:
        last = r.stderr.strip().splitlines()[-1]
        assert re.search(report, last), last
        assert "failed (exitcode" not in r.stderr   # torch's agent line: the last line says it, naming the rank
        injected = float(re.search(r"injecting \w+ on rank \d+ at step \d+ at ([0-9.]+)", r.stdout).group(1))
        assert r.ended - injected < TIMEOUT_S + 10, "the job ended, but not within the collective timeout"


def _pids(stdout: str) -> dict[int, tuple[int, int]]:
    """rank -> (pid, parent pid) from the harness's start lines."""
    return {int(r): (int(p), int(pp)) for r, p, pp in re.findall(r"rank (\d+) starts at step \d+ pid (\d+) parent (\d+)", stdout)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_the_launcher_ends_its_workers_and_a_relaunch_loses_nothing(tmp_path, uninterrupted):
    count("faults injected")
    r = launch(tmp_path / "ckpt", "killlauncher@0:3", step_sleep=0.5)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    pids = _pids(r.stdout)
    assert len(pids) == 2 and {pp for _, pp in pids.values()} == {r.pid}   # the workers are the launcher's children
    assert not r.left_behind, f"workers {r.left_behind} kept running after their launcher was killed"
    r = launch(tmp_path / "ckpt", "")       # started again by hand (or by a scheduler)
    outcome = classify(r, uninterrupted)
    if outcome == "survived, nothing lost":
        count(outcome)
    assert outcome == "survived, nothing lost", (outcome, r.stderr[-3000:])
