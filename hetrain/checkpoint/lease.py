"""One job at a time in a checkpoint directory: a lease file that names its holder and carries a heartbeat.

`<dir>/lease.json` names the job (TORCHELASTIC_RUN_ID), the host, the pid of the job's rank 0 and a
heartbeat counter that a thread of that process advances every HEARTBEAT_SECONDS. Another job is
refused with one line naming the holder while the holder lives:
- the same job (same run id, e.g. after an elastic restart; or the same process) takes it at once;
- a holder on this host (same pid namespace) lives while its pid does;
- a holder elsewhere lives while its heartbeat moves; one that does not move for STALE_SECONDS
  (measured on this host's monotonic clock, so clock skew between nodes does not matter) is dead,
  and its lease is taken over.
Only a job's rank 0 holds the lease; the other ranks learn the outcome from it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hetrain.checkpoint.errors import CheckpointError, describe_os_error, os_error_fix

LEASE_NAME = "lease.json"
HEARTBEAT_SECONDS = 2.0
STALE_SECONDS = 30.0
_SETTLE_SECONDS = 0.2  # after a takeover, how long before reading back who won a simultaneous one
_FORMAT = "hetrain-lease"

log = logging.getLogger("hetrain.checkpoint")


@dataclass(frozen=True)
class Holder:
    """What a lease file says about the process that holds it."""

    job: str | None
    host: str
    pidns: str
    pid: int
    token: str
    heartbeat: int = 0
    heartbeat_unix: float = 0.0

    def describe(self) -> str:
        """`job abc (host h, pid 12)` for messages."""
        job = f"job {self.job}" if self.job else "a job without a run id"
        return f"{job} (host {self.host}, pid {self.pid})"

    def same_job(self, other: "Holder") -> bool:
        """Same elastic run (a restart of this job) or the very same process."""
        if self.job is not None and self.job == other.job:
            return True
        return (self.host, self.pidns, self.pid) == (other.host, other.pidns, other.pid)


def this_process() -> Holder:
    """The holder this process would be: run id from the elastic agent (None when unknown), host, pid."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or None
    if job == "none":  # torchrun's default --rdzv-id: shared by unrelated jobs, so no identity
        job = None
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return Holder(job=job, host=socket.gethostname(), pidns=pidns, pid=os.getpid(), token=uuid.uuid4().hex)


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid namespace runs (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def read_holder(path: Path) -> Holder | None:
    """The lease at `path`; None when there is none. A malformed file names a holder nobody matches."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        d = json.loads(text)
        if d.pop("format") != _FORMAT:
            raise ValueError(d)
        return Holder(**d)
    except (ValueError, TypeError, KeyError, AttributeError):
        return Holder(job=None, host="(unreadable lease file)", pidns="", pid=0, token=f"malformed:{hash(text)}")


def _write_tmp(directory: Path, holder: Holder) -> Path:
    tmp = directory / f".lease-{holder.token}-{holder.heartbeat}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"format": _FORMAT, **asdict(holder)}, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
    except OSError:   # a full disk: no empty file left behind each beat
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _create(path: Path, holder: Holder) -> bool:
    """Create the lease if there is none (atomic: a hard link fails when the name exists)."""
    tmp = _write_tmp(path.parent, holder)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _overwrite(path: Path, holder: Holder) -> None:
    tmp = _write_tmp(path.parent, holder)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


_FLAGS = {"checkpoint directory": "--checkpoint-dir", "run directory": "--run-dir"}


def _refusal(directory: Path, holder: Holder, what: str) -> CheckpointError:
    age = time.time() - holder.heartbeat_unix
    return CheckpointError(
        f"{what} {directory} is in use by {holder.describe()}, heartbeat {age:.0f} s ago; two jobs "
        f"must not share a {what}: pass another {_FLAGS[what]} or stop that job (a holder whose "
        f"heartbeat stops for {STALE_SECONDS:.0f} s is taken over; if it is gone, delete {directory / LEASE_NAME})")


class Lease:
    """This process's hold on one checkpoint directory (or run directory: ``what``), refreshed by a daemon
    thread until released."""

    def __init__(self, directory: Path, what: str = "checkpoint directory") -> None:
        self.directory = directory
        self.what = what
        self.path = directory / LEASE_NAME
        self.me = replace(this_process(), heartbeat_unix=time.time())
        self.lost: Holder | None = None
        self._failing = False   # the last heartbeat could not be written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # reentrant: release() may run from a garbage-collection finalizer in any thread, this one included
        self._lock = threading.RLock()

    def take(self) -> None:
        """Take the lease, waiting only to tell a dead holder elsewhere from a live one; refuse a live one."""
        try:
            self._take()
        except OSError as e:
            raise CheckpointError(f"cannot write the lease {self.path} ({describe_os_error(e)}); "
                                  f"{os_error_fix(e, self.what, _FLAGS[self.what])}") from None

    def start_heartbeat(self) -> None:
        """Refresh the lease from a daemon thread until released (a lease released before this stays released).

        Call it holding no lock a finalizer may need: a thread's start can run garbage collection in the new
        thread, and a finalizer there (another Checkpointer's `let_go`) must not wait on the starting thread."""
        self._thread = threading.Thread(target=self._beat, name="hetrain-ckpt-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        watched: tuple[str, int] | None = None
        since = 0.0
        while True:
            current = read_holder(self.path)
            if current is None:
                if _create(self.path, self.me):
                    return
                continue
            if current.token == self.me.token:
                return
            local = (current.host, current.pidns) == (self.me.host, self.me.pidns)
            if current.same_job(self.me):  # a restart of this job: no other job can be taking it at once
                if self._take_over(current, settle=0.0):
                    return
                continue
            if local and not pid_alive(current.pid):
                if self._take_over(current):
                    return
                continue
            if local:
                raise _refusal(self.directory, current, self.what)
            seen = (current.token, current.heartbeat)
            if watched is None or seen != watched:
                if watched is not None:  # its heartbeat moved: it lives
                    raise _refusal(self.directory, current, self.what)
                watched, since = seen, time.monotonic()
                log.warning("%s %s is held by %s; waiting up to %.0f s to see whether it lives", self.what,
                            self.directory, current.describe(), STALE_SECONDS)
            elif time.monotonic() - since >= STALE_SECONDS:
                log.warning("taking over the lease of %s on %s: its heartbeat has not moved for %.0f s",
                            current.describe(), self.directory, STALE_SECONDS)
                if self._take_over(current):
                    return
                watched = None
                continue
            time.sleep(HEARTBEAT_SECONDS / 4)

    def _take_over(self, previous: Holder, settle: float = _SETTLE_SECONDS) -> bool:
        """Replace `previous`'s lease with ours; False when another taker won at the same moment."""
        if read_holder(self.path) != previous:
            return False
        _overwrite(self.path, self.me)
        time.sleep(settle)
        now = read_holder(self.path)
        return now is not None and now.token == self.me.token

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    current = read_holder(self.path)
                    if current is not None and current.token != self.me.token:
                        if not current.same_job(self.me):
                            self.lost = current
                        return  # handed to another holder: it refreshes from now on
                    self.me = replace(self.me, heartbeat=self.me.heartbeat + 1, heartbeat_unix=time.time())
                    if current is None:
                        _create(self.path, self.me)
                    else:
                        _overwrite(self.path, self.me)
                    if self._stop.is_set():  # released while this beat wrote (a finalizer in this thread)
                        self._remove_if_ours()
                        return
                self._failing = False
            except OSError as e:  # a hiccup of the filesystem: the next beat tries again (said once until one works)
                if not self._failing:
                    log.warning("could not refresh the lease %s (%s); trying again every %.0f s", self.path,
                                describe_os_error(e), HEARTBEAT_SECONDS)
                self._failing = True

    def check(self) -> str | None:
        """None while this process holds the lease; else why it does not (for a refused commit)."""
        current = self.lost or read_holder(self.path)
        if current is None or current.token == self.me.token or current.same_job(self.me):
            return None
        return (f"{self.directory} was taken over by {current.describe()}; two jobs must not share a checkpoint "
                f"directory: stop one of them or pass another --checkpoint-dir")

    def _remove_if_ours(self) -> None:
        try:
            current = read_holder(self.path)
            if current is not None and current.token == self.me.token:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours."""
        if os.getpid() != self.me.pid:  # a forked child (a DataLoader worker) never gives back its parent's lease
            return
        self._stop.set()
        with self._lock:
            self._remove_if_ours()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=HEARTBEAT_SECONDS)


_held: dict[str, tuple[Lease, int]] = {}
# Reentrant: a finalizer calling let_go may run in this thread while hold() holds it. No thread is started
# while it is held: a finalizer run by the new thread's start would wait on it, and the start on that thread.
_held_lock = threading.RLock()


def hold(directory: Path, what: str = "checkpoint directory") -> str:
    """Take (or share, within this process) the lease on `directory`; returns the key for `let_go`.
    `what` the directory is for names it in a refusal: "checkpoint directory" or "run directory"."""
    key = os.path.realpath(directory)
    with _held_lock:
        if key in _held:
            lease, count = _held[key]
            _held[key] = (lease, count + 1)
            return key
        lease = Lease(Path(key), what)
        lease.take()
        _held[key] = (lease, 1)
    lease.start_heartbeat()
    return key


def let_go(key: str) -> None:
    """Give back one hold taken by `hold`; the last one releases the lease."""
    with _held_lock:
        if key not in _held:
            return
        lease, count = _held[key]
        if count > 1:
            _held[key] = (lease, count - 1)
            return
        del _held[key]
    lease.release()


def release_all() -> None:
    """Give back every lease this process holds: for a process about to end with os._exit, which runs no
    finalizers (a held lease would make a job on another host wait STALE_SECONDS for it)."""
    with _held_lock:
        leases = [lease for lease, _ in _held.values()]
        _held.clear()
    for lease in leases:
        lease.release()


def lost(key: str) -> str | None:
    """None while this process holds the lease of `key`; else the reason (see `Lease.check`)."""
    with _held_lock:
        entry = _held.get(key)
    if entry is None:
        return f"this process no longer holds the lease on {key}; create a new Checkpointer"
    return entry[0].check()


def seen_within(directory: Path, token: str, seconds: float) -> tuple[bool, str | None]:
    """(whether `directory`'s lease file, with this token, is seen here within `seconds` (polled), the
    last error reading it: a network file system's passing one, "stale file handle", is polled past)."""
    deadline, error = time.monotonic() + seconds, None
    while True:
        try:
            holder, error = read_holder(Path(directory) / LEASE_NAME), None
        except OSError as e:
            holder, error = None, describe_os_error(e)
        if holder is not None and holder.token == token:
            return True, None
        if time.monotonic() >= deadline:
            return False, error
        time.sleep(0.5)


def holder_of(directory: Path) -> Holder | None:
    """The holder named in `directory`'s lease file (None when free): for messages and tests."""
    return read_holder(directory / LEASE_NAME)
