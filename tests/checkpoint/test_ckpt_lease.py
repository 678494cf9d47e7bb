"""One job per checkpoint directory, a directory checked before any training, and errors that name their cause."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from hetrain.checkpoint import CheckpointError, Checkpointer, lease

_JOB = textwrap.dedent("""
    import os, sys, time, torch
    from pathlib import Path
    from hetrain.checkpoint import Checkpointer, CheckpointError
    root, job, go = sys.argv[1], sys.argv[2], sys.argv[3]
    if go != "-":
        Path(go + "." + job).touch()        # imported and ready
        while not Path(go).exists():
            time.sleep(0.01)
    try:
        ckpt = Checkpointer(root, async_save=False)
    except CheckpointError as e:
        print(e, file=sys.stderr)
        sys.exit(3)
    ckpt.save(1, {"job": job}, {})
    if sys.argv[4] == "die":
        os._exit(0)                          # killed: the lease stays behind, naming a dead pid
    time.sleep(float(sys.argv[4]))
    ckpt.save(2, {"job": job}, {})
    ckpt.close()
""")


def _start(root: Path, job: str, go: str = "-", then: str = "0") -> subprocess.Popen:
    env = {**os.environ, "TORCHELASTIC_RUN_ID": job}
    return subprocess.Popen([sys.executable, "-c", _JOB, str(root), job, go, then], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.strip()


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_a_second_job_is_refused_at_start_with_one_line_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    first = Checkpointer(tmp_path, async_save=True)
    first.save(1, {"w": torch.ones(3)}, {})
    code, err = _finish(_start(tmp_path, "job-b"))
    assert code == 3 and "\n" not in err, err
    assert f"is in use by job job-a (host {socket.gethostname()}, pid {os.getpid()})" in err
    assert "--checkpoint-dir" in err and "free space" not in err
    first.save(2, {"w": torch.full((3,), 2.0)}, {})  # the holder goes on, untouched
    first.wait()
    assert _steps(tmp_path) == ["step-000001", "step-000002"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("step-")) == ["lease.json"]
    first.close()
    assert not (tmp_path / "lease.json").exists(), "close() gives the directory back"
    code, err = _finish(_start(tmp_path, "job-b"))
    assert code == 0, err
    assert Checkpointer(tmp_path).load()[0] == {"job": "job-b"}


def test_two_jobs_started_together_one_runs_the_other_is_refused(tmp_path):
    root, go = tmp_path / "ckpt", tmp_path / "go"
    procs = [_start(root, job, str(go), then="1.0") for job in ("job-1", "job-2")]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.{job}").exists() for job in ("job-1", "job-2")) and time.monotonic() < deadline:
        time.sleep(0.02)
    go.touch()  # both are past their imports: they create their Checkpointers at the same moment
    outcomes = [_finish(p) for p in procs]
    codes = sorted(code for code, _ in outcomes)
    assert codes == [0, 3], outcomes
    winner = ["job-1", "job-2"][[code for code, _ in outcomes].index(0)]
    refused = next(err for code, err in outcomes if code == 3)
    assert f"is in use by job {winner}" in refused and "\n" not in refused
    assert _steps(root) == ["step-000001", "step-000002"]
    assert Checkpointer(root).load()[0] == {"job": winner}


def test_the_same_job_shares_the_directory_and_a_dead_holder_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    holder = Checkpointer(tmp_path / "shared")
    code, err = _finish(_start(tmp_path / "shared", "job-a"))  # another process of job-a: a restart
    assert code == 0, err
    holder.close()

    code, err = _finish(_start(tmp_path / "dead", "job-z", then="die"))
    assert code == 0, err
    assert lease.holder_of(tmp_path / "dead").job == "job-z", "a killed job leaves its lease behind"
    started = time.monotonic()
    taker = Checkpointer(tmp_path / "dead")  # job-a on the same host: job-z's pid is gone
    assert time.monotonic() - started < 5
    assert lease.holder_of(tmp_path / "dead").job == "job-a"
    assert taker.latest().step == 1
    taker.close()


def _write_lease(root: Path, host: str, beat: int) -> None:
    """A lease as another node's job writes it (whole, by rename)."""
    tmp = root / ".lease-elsewhere.tmp"
    tmp.write_text(json.dumps({
        "format": "hetrain-lease", "job": "job-elsewhere", "host": host, "pidns": "pid:[1]", "pid": 4242,
        "token": "t-elsewhere", "heartbeat": beat, "heartbeat_unix": time.time()}))
    os.replace(tmp, root / lease.LEASE_NAME)


@pytest.fixture
def quick_lease(monkeypatch):
    monkeypatch.setattr(lease, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setattr(lease, "STALE_SECONDS", 1.5)


def test_a_live_holder_on_another_node_is_refused_a_silent_one_taken_over(tmp_path, quick_lease):
    _write_lease(tmp_path, "node-7", 0)
    stop = threading.Event()

    def beat() -> None:  # the other node's job is alive: its heartbeat moves
        n = 0
        while not stop.wait(0.05):
            n += 1
            _write_lease(tmp_path, "node-7", n)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"in use by job job-elsewhere \(host node-7, pid 4242\)"):
            Checkpointer(tmp_path)
        assert time.monotonic() - started < 1.5, "refused as soon as its heartbeat moved"
    finally:
        stop.set()
        thread.join()
    started = time.monotonic()
    ckpt = Checkpointer(tmp_path)  # its heartbeat no longer moves: dead, taken over
    assert time.monotonic() - started >= 1.5
    assert lease.holder_of(tmp_path).pid == os.getpid()
    ckpt.close()


def test_a_save_after_another_job_took_the_directory_is_not_committed(tmp_path, quick_lease):
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, {"w": torch.ones(2)}, {})
    ckpt.wait()
    _write_lease(tmp_path, "node-7", 0)  # as if this process had stalled and another job took over
    time.sleep(0.5)
    ckpt.save(2, {"w": torch.ones(2)}, {})
    with pytest.raises(CheckpointError, match=r"step 2 was not committed: .* taken over by job job-elsewhere "
                                              r"\(host node-7, pid 4242\)"):
        ckpt.wait()
    assert _steps(tmp_path) == ["step-000001"] and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("code, fix", [
    (errno.ENOSPC, "the filesystem is full: free space"),
    (errno.EDQUOT, "this user's disk quota is full: free space under it"),
    (errno.EFBIG, "a file is larger than the filesystem or this process's file-size limit (ulimit -f) allows"),
    (errno.ENOENT, "only one job may use a checkpoint directory"),
    (errno.EACCES, "may not write there"),
    (errno.EROFS, "read-only"),
    (errno.EIO, "writable"),
])
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_failed_write_names_its_cause_and_only_a_full_disk_blames_free_space(tmp_path, monkeypatch, code, fix,
                                                                               wrapped):
    ckpt = Checkpointer(tmp_path, async_save=False)

    def failing(*args, **kwargs):
        error = OSError(code, os.strerror(code))
        if wrapped:  # as torch's writer reports a failed write
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from error
        raise error

    monkeypatch.setattr("hetrain.checkpoint.checkpointer.write_torch_file", failing)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(1, {"w": torch.ones(2)}, {})
    message = str(e.value)
    assert os.strerror(code) in message and fix in message and "\n" not in message
    assert ("free space" in message) == (code in (errno.ENOSPC, errno.EDQUOT))
    assert ("check that the checkpoint directory is writable" in message) == (code == errno.EIO)


def test_a_checkpoint_dir_that_is_a_file_or_under_a_file_is_refused_at_start(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"checkpoint directory {path} exists and is not a directory; pass"):
        Checkpointer(path)
    with pytest.raises(CheckpointError, match=rf"checkpoint directory {path / 'sub'} cannot be created: a part"):
        Checkpointer(path / "sub")


def test_a_checkpoint_dir_that_is_a_dangling_link_names_the_link_and_its_target(tmp_path):
    """A link to a volume that is not mounted was refused as 'a part of its path is a file'."""
    (tmp_path / "ckpt").symlink_to(tmp_path / "volume" / "ckpt")
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "run1"):
        with pytest.raises(CheckpointError, match=rf"{tmp_path / 'ckpt'} is a link to {tmp_path / 'volume' / 'ckpt'}, "
                                                  "which does not exist; create the link's target"):
            Checkpointer(path)
    assert not (tmp_path / "volume").exists()   # the target is not made: it may be a volume's mount point


_READ_ONLY = textwrap.dedent("""
    import sys
    from hetrain.checkpoint import Checkpointer, CheckpointError
    try:
        Checkpointer(sys.argv[1])
    except CheckpointError as e:
        print(e, file=sys.stderr)
        sys.exit(3)
""")


def _without_root_powers() -> None:
    """In the child, before exec: root writes anywhere, so drop the capabilities that let it (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER, from the bounding set
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("where", ["the directory", "a directory to create in it"])
def test_a_read_only_checkpoint_dir_is_refused_at_start(tmp_path, where):
    base = tmp_path / "read-only"
    base.mkdir()
    base.chmod(0o555)
    target = base if where == "the directory" else base / "ckpt"
    try:
        proc = subprocess.run([sys.executable, "-c", _READ_ONLY, str(target)], capture_output=True, text=True,
                              timeout=120, preexec_fn=_without_root_powers if os.geteuid() == 0 else None)
        message = proc.stderr.strip()
        assert proc.returncode == 3 and "\n" not in message, message
        assert str(target) in message and "Permission denied" in message
        assert "may not write there: fix the directory's permissions or pass another --checkpoint-dir" in message
        assert list(base.iterdir()) == []
    finally:
        base.chmod(0o755)


def test_a_forked_child_never_gives_back_its_parents_lease(tmp_path):
    ckpt = Checkpointer(tmp_path)
    pid = os.fork()  # as a DataLoader worker is forked from a rank
    if pid == 0:
        try:
            ckpt.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert lease.holder_of(tmp_path).pid == os.getpid()
    ckpt.close()
    assert lease.holder_of(tmp_path) is None


def test_release_all_frees_the_directories_before_an_abrupt_exit(tmp_path):
    code = textwrap.dedent("""
        import os, sys
        from hetrain.checkpoint import Checkpointer, lease
        kept = [Checkpointer(sys.argv[1] + "/a"), Checkpointer(sys.argv[1] + "/b")]
        lease.release_all()
        os._exit(2)   # as a worker ends on a user error: no finalizers run
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert lease.holder_of(tmp_path / "a") is None and lease.holder_of(tmp_path / "b") is None


def test_a_lease_given_back_by_another_thread_while_a_new_heartbeat_starts_does_not_deadlock(tmp_path, monkeypatch):
    """A thread's start may run garbage collection in the new thread, and a collected Checkpointer's
    finalizer gives its lease back there. The suite once hung for good that way: `hold` started the
    heartbeat holding the lock `let_go` takes, and the start waited on the thread that waited on it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = lease.hold(tmp_path / "a")
    start = lease.Lease.start_heartbeat
    done = []

    def start_while_another_thread_lets_go(self):
        helper = threading.Thread(target=lambda: (lease.let_go(first), done.append(True)), daemon=True)
        helper.start()
        helper.join(timeout=5)
        start(self)

    monkeypatch.setattr(lease.Lease, "start_heartbeat", start_while_another_thread_lets_go)
    second = lease.hold(tmp_path / "b")
    assert done == [True]                                  # let_go ran to its end while the heartbeat started
    assert not (tmp_path / "a" / lease.LEASE_NAME).exists() and (tmp_path / "b" / lease.LEASE_NAME).exists()
    lease.let_go(second)
    assert not (tmp_path / "b" / lease.LEASE_NAME).exists()


def _prepare_with_a_run_directory(rank: int, world: int, run_dir: str) -> str | None:
    import torch.distributed as dist

    import hetrain

    dist.init_process_group("gloo")
    os.environ["HETRAIN_RUN_DIR"] = run_dir   # hetrain launch --run-dir, with its own checkpoint directory
    os.environ["TORCHELASTIC_RUN_ID"] = "job-b"
    session = hetrain.Session(balance=False)
    net = torch.nn.Linear(2, 2)
    session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        session.loader(torch.utils.data.TensorDataset(torch.randn(8, 2)), global_batch_size=4)
    except hetrain.HetrainError as e:
        return str(e)
    session.close()
    return None


def test_a_second_job_on_a_run_directory_in_use_is_refused_naming_the_holder(tmp_path, monkeypatch):
    from tests.distributed import run_ranks

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    key = lease.hold(tmp_path, "run directory")   # job A writes its run log there
    refused = run_ranks(_prepare_with_a_run_directory, 2, str(tmp_path))
    assert refused[0] == refused[1] or refused[1].startswith("rank 0"), refused
    assert f"run directory {tmp_path} is in use by job job-a" in refused[0] and "--run-dir" in refused[0], refused
    assert not (tmp_path / "metrics").exists() or not list((tmp_path / "metrics").iterdir()), "no line of B's"
    lease.let_go(key)
    assert run_ranks(_prepare_with_a_run_directory, 2, str(tmp_path)) == [None, None]
    assert not (tmp_path / "lease.json").exists(), "close() gives the run directory back"


_NEVER_CLOSED = """
import sys, torch, hetrain
session = hetrain.Session(balance=False)
net = torch.nn.Linear(2, 2)
session.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
session.loader(torch.utils.data.TensorDataset(torch.randn(8, 2)), global_batch_size=4)
raise SystemExit(3)   # the script ends without session.close()
"""


def test_a_run_directory_is_given_back_when_the_process_ends_without_close(tmp_path):
    """Else a job on another node waits STALE_SECONDS for a holder that is gone."""
    env = {**os.environ, "HETRAIN_RUN_DIR": str(tmp_path)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _NEVER_CLOSED], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert (tmp_path / "metrics").is_dir() and not (tmp_path / "lease.json").exists()


def test_a_heartbeat_on_a_full_disk_is_said_once_and_leaves_no_file_behind(tmp_path, monkeypatch):
    from tests.log_lines import hetrain_warnings

    monkeypatch.setattr(lease, "HEARTBEAT_SECONDS", 0.02)
    key = lease.hold(tmp_path, "run directory")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    import types

    with hetrain_warnings() as warned:
        monkeypatch.setattr(lease, "os", types.SimpleNamespace(**{**vars(os), "replace": full}))
        time.sleep(0.5)
        monkeypatch.setattr(lease, "os", os)
        time.sleep(0.2)
    lease.let_go(key)
    said = [line for line in warned if f"could not refresh the lease {tmp_path}" in line]
    assert len(said) == 1 and "No space left" in said[0], warned
    assert not list(tmp_path.glob(".lease-*")), list(tmp_path.iterdir())


def test_a_lease_on_a_read_only_run_directory_names_the_run_directory_flag(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(lease, "_write_tmp", read_only)
    with pytest.raises(CheckpointError, match=r"read-only: pass a writable --run-dir$"):
        lease.hold(tmp_path, "run directory")
