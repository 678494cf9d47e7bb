"""Checkpointer: atomic, verified, optionally background checkpoints written by every rank together.

Layout of one checkpoint (`<dir>/step-000123/`):
  manifest.json     format version, step, world size, every file with its size and sha256
  shared.pt         state identical on all ranks (rank 0 writes it)
  rank-00000.pt ... each rank's own state (RNG states, local statistics)
  sharded/          state sharded across ranks, written by torch.distributed.checkpoint

All ranks write into `<dir>/.tmp-step-000123/`; once every rank reports success, rank 0 writes the
manifest, fsyncs and renames the directory to `step-000123/`. A crash at any point leaves either
the complete checkpoint or none. Coordination runs on a gloo group of its own, so a background
save never interleaves with the training's collectives.

The directory is checked when the Checkpointer is created (a directory every rank can write) and
held by one job at a time (`lease.json`, see lease.py) until `close()`. Damaged checkpoints are set
aside as `damaged-step-N`, and a directory whose every checkpoint is damaged stops the job (see
selection.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from hetrain.exiting import once_at_exit
from hetrain.checkpoint import lease, selection, store
from hetrain.checkpoint.errors import CheckpointError, describe_os_error, os_error_fix, os_error_in
from hetrain.checkpoint.manifest import (
    SHARDED_DIR, SHARED_FILE, FileEntry, Manifest, check_layout, rank_file, read_manifest, verify, write_manifest,
)
from hetrain.checkpoint.safe_io import fsync_dir, fsync_file, read_torch_file, sha256_file, snapshot, write_torch_file

log = logging.getLogger("hetrain")

__all__ = ["SHARED_FILE", "CheckpointInfo", "CheckpointWarning", "Checkpointer", "rank_file"]


class CheckpointWarning(UserWarning):
    """A checkpoint was passed over (and, when damaged, set aside) because it is damaged or unfinished."""


def sharded_io() -> Any:
    """hetrain.checkpoint.sharded, imported with the first sharded save or load: torch.distributed.checkpoint
    adds over half a second to each rank's start-up, which a job without sharded state does not need."""
    from hetrain.checkpoint import sharded

    return sharded


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint found on disk."""

    step: int
    path: Path
    world_size: int
    sharded: bool
    bytes: int


EXIT_SAVE_WAIT_S = 120.0   # how long a process's exit waits for a background save still being written
_SAVING: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def finish_saves_at_exit() -> None:
    """The process exits: every background save it started is finished first (each rank joins its own; a save's
    collectives pair with the other ranks', which exit through the same script)."""
    deadline = time.monotonic() + EXIT_SAVE_WAIT_S
    for checkpointer in list(_SAVING):
        checkpointer.finish_save(max(0.0, deadline - time.monotonic()))



class Checkpointer:
    """Saves and loads checkpoints of one job; every rank of the job holds one and calls it together.

    Creating one is collective: every rank checks that it can write `directory`, and rank 0 takes the
    directory's lease (another job holding it is refused with one line naming it). `close()` gives
    the lease back; a later `save()` takes it again. `start_fresh` (default: HETRAIN_START_FRESH) lets
    `latest()` return None when checkpoints exist and none verifies, instead of stopping the job.
    """

    def __init__(self, directory: str | Path, *, keep: int | None = 3, async_save: bool = True,
                 process_group: Any = None, start_fresh: bool | None = None) -> None:
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep={keep}: at least one checkpoint must be kept; pass keep>=1 (None keeps all)")
        self.directory = Path(directory).absolute()   # the process may change directory; its saves stay here
        for earlier in list(_SAVING):   # an earlier session of this process still writing here (a notebook cell
            if earlier.directory == self.directory:   # stopped and run again): its save ends before this one looks
                earlier.finish_save(EXIT_SAVE_WAIT_S)
        self.keep = keep
        self.async_save = async_save
        self.start_fresh = selection.start_fresh_from_env() if start_fresh is None else bool(start_fresh)
        self._group = _coordination_group(process_group)
        self.rank = dist.get_rank(self._group) if self._group is not None else 0
        self.world_size = dist.get_world_size(self._group) if self._group is not None else 1
        self._holding = False
        self._lease_key: str | None = None
        self._release: weakref.finalize | None = None
        self._hold_directory()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._verified: set[tuple[Path, float]] = set()
        self._unremovable: set[str] = set()
        self._buffers: dict[str, Any] = {}  # host copies reused by background saves
        self._stager: Any = None   # DCP's stager, made with the first background save of sharded state
        self.last_save_seconds = 0.0
        self.last_blocking_seconds = 0.0
        self.last_bytes = 0
        self._committed: list[tuple[int, float, int]] = []   # (step, seconds until committed, bytes)
        self._committed_lock = threading.Lock()

    # ---- saving -------------------------------------------------------------------------------

    def save(self, step: int, shared: dict, per_rank: dict, sharded: dict | None = None, *,
             blocking: bool | None = None) -> None:
        """Collective: write one checkpoint of `step` (in the background unless blocking)."""
        start = time.perf_counter()
        self.wait()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step={step!r}: a checkpoint step is an integer >= 0")
        if not self._holding:
            self._hold_directory()  # given back by close(): take it again
        blocking = (not self.async_save) if blocking is None else blocking
        copy = not blocking
        shared_s = per_rank_s = sharded_s = None
        error = None
        try:
            if self.rank == 0:
                shared_s = snapshot(shared, copy=copy, where="shared", buffers=self._buffers if copy else None)
            per_rank_s = snapshot(per_rank, copy=copy, where="per_rank", buffers=self._buffers if copy else None)
            if sharded is not None:
                if copy and self._stager is None:
                    self._stager = sharded_io().Stager()
                sharded_s = self._stager.stage(sharded) if copy else sharded
        except CheckpointError as e:
            error = e
        tmp = store.tmp_dir(self.directory, step)
        if self.rank == 0 and error is None:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = CheckpointError(f"cannot create {tmp} ({describe_os_error(e)}); {os_error_fix(e)}")
        # agreed here, background save or not: a value that cannot be saved is refused by this save() on every
        # rank, not by the next one (or close()) an interval later
        first = self._first_error(None if error is None else str(error))
        if first is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error if error is not None else CheckpointError(first)
        args = (step, tmp, shared_s, per_rank_s, sharded_s, sharded is not None, start)
        if blocking:
            self._write(*args)
        else:
            self._thread = threading.Thread(target=self._background, args=args, name=f"hetrain-ckpt-{step}",
                                            daemon=True)
            self._thread.start()
            _SAVING.add(self)
            once_at_exit(finish_saves_at_exit)
        self.last_blocking_seconds = time.perf_counter() - start

    def finish_save(self, timeout_s: float) -> None:
        """A background save still being written, joined for up to `timeout_s`: at exit (a script that never closed
        its session; a daemon thread writing while the interpreter is torn down loses the checkpoint and can abort
        the process, "terminate called without an active exception"), or before a new Checkpointer of this
        process looks in the same directory."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def wait(self) -> None:
        """Block until the background save (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish the pending save and give the directory's lease back."""
        try:
            self.wait()
        finally:
            self._let_go()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def _write(self, step: int, tmp: Path, shared: Any, per_rank: Any, sharded: Any, has_sharded: bool,
               start: float) -> None:
        error: BaseException | None = None
        entries: list[FileEntry] = []
        try:
            if has_sharded:
                sharded_io().save_sharded(sharded, tmp, self._group)
            if self.rank == 0:
                entries.append(FileEntry(SHARED_FILE, *write_torch_file(shared, tmp / SHARED_FILE)))
            name = rank_file(self.rank)
            entries.append(FileEntry(name, *write_torch_file(per_rank, tmp / name)))
            if has_sharded:
                entries.extend(self._hash_my_share(tmp / SHARDED_DIR))
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            error = e if isinstance(e, CheckpointError) else _write_error(tmp, self.rank, e)
        gathered = self._gather((None if error is None else str(error), entries))
        outcome: tuple[str | None, int, str] = (None, 0, "")
        if self.rank == 0:
            outcome = self._commit(step, tmp, gathered, has_sharded)
        outcome = self._broadcast(outcome)
        reason, nbytes, path = outcome
        if reason is not None:
            raise error if error is not None else CheckpointError(reason)
        self.last_bytes = nbytes
        self.last_save_seconds = time.perf_counter() - start
        with self._committed_lock:
            self._committed.append((step, self.last_save_seconds, nbytes))

    def take_committed(self) -> list[tuple[int, float, int]]:
        """(step, seconds from save() until committed, bytes) of each checkpoint committed since the
        last call, background saves included once they are done."""
        with self._committed_lock:
            done, self._committed = self._committed, []
        return done

    def _hash_my_share(self, sharded_dir: Path) -> list[FileEntry]:
        """Hash this rank's part of the DCP files (the listing split across ranks)."""
        names = sorted(p.relative_to(sharded_dir).as_posix() for p in sharded_dir.rglob("*") if p.is_file())
        out = []
        for i, name in enumerate(names):
            if i % self.world_size == self.rank:
                fsync_file(sharded_dir / name)
                out.append(FileEntry(f"{SHARDED_DIR}/{name}", *sha256_file(sharded_dir / name)))
        if self.rank == 0:
            fsync_dir(sharded_dir)
        return out

    def _commit(self, step: int, tmp: Path, gathered: list, has_sharded: bool) -> tuple[str | None, int, str]:
        errors = [f"rank {r}: {err}" for r, (err, _) in enumerate(gathered) if err is not None]
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"checkpoint of step {step} was not written: " + "; ".join(errors), 0, ""
        files = sorted((e for _, entries in gathered for e in entries), key=lambda e: e.path)
        manifest = Manifest(step=step, world_size=self.world_size, files=files, sharded=has_sharded)
        taken = lease.lost(self._lease_key) if self._lease_key is not None else None
        if taken is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return f"checkpoint of step {step} was not committed: {taken}", 0, ""
        try:
            write_manifest(tmp, manifest)
            final = store.commit(self.directory, tmp, step)
            _, failed = store.prune(self.directory, self.keep, newest=final)
        except OSError as e:
            return f"committing {tmp} failed ({describe_os_error(e)}); {os_error_fix(e)}", 0, ""
        self._verified.add((final, manifest.created_unix))
        new, self._unremovable = set(failed) - self._unremovable, self._unremovable | set(failed)
        for entry in new:   # said once each: every later save tries again
            try:
                warnings.warn(f"old checkpoint {entry} ({failed[entry]}) could not be deleted; it takes disk space "
                              "until it is: delete it by hand", CheckpointWarning, stacklevel=2)
            except CheckpointWarning as w:   # an error under the script's filters, raised on rank 0 alone after
                log.warning("%s", w)         # the step was committed: said, not a save failed on one rank
        return None, manifest.total_bytes, str(final)

    # ---- finding and loading -------------------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """Collective: the newest checkpoint that verifies (rank 0 checks, all ranks get its choice).

        Damaged checkpoints newer than it are set aside as `damaged-step-N` and reported with a
        CheckpointWarning. When checkpoints exist and none verifies, CheckpointError names them,
        unless `start_fresh`: then they are set aside and the answer is None (start from step 0).
        """
        self.wait()
        outcome: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            try:
                outcome = self._find_latest()
            except OSError as e:
                outcome = (None, f"cannot look for checkpoints in {self.directory} ({describe_os_error(e)}); "
                                 f"{os_error_fix(e)}")
            except CheckpointError as e:   # (a manifest of a newer hetrain): every rank stops on it, not rank 0 alone
                outcome = (None, str(e))
            except CheckpointWarning as w:   # raised by the script's filters (-W error): every rank stops on it
                outcome = (None, f"stopped on a CheckpointWarning, which this script's warning filters make an error: "
                                 f"{w}; allow it with warnings.filterwarnings('default', category=hetrain.checkpoint."
                                 "CheckpointWarning)")
        chosen, refusal = self._broadcast(outcome)
        if refusal is not None:
            self._let_go()  # the job stops here: the next launch need not wait for this one's lease
            raise CheckpointError(refusal)
        return None if chosen is None else _info(Path(chosen))

    def _find_latest(self) -> tuple[str | None, str | None]:
        """(path of the chosen checkpoint or None, the refusal or None); rank 0 only."""
        for line in store.restore_replaced(self.directory):   # not a warning: nothing is lost, -W error need not stop
            log.warning("checkpoint directory %s: %s", self.directory, line)
        choice = selection.choose(self.directory)
        for entry in choice.unfinished:
            step = int(entry.name[len(store.TMP_PREFIX):])
            warnings.warn(f"{entry} is an unfinished save of step {step} and is ignored", CheckpointWarning,
                          stacklevel=4)
        if choice.chosen is None and choice.damaged and not self.start_fresh:
            return None, selection.refusal(self.directory, choice.damaged)
        after = (f"resuming from {choice.chosen.name}" if choice.chosen is not None else
                 "starting from step 0 as start_fresh asks")
        for path, reason in choice.damaged:
            aside = store.set_aside(path)
            warnings.warn(f"checkpoint {path} is damaged ({reason}); set aside as {aside.name}, {after}",
                          CheckpointWarning, stacklevel=4)
        if choice.chosen is None:
            return None, None
        self._verified.add((choice.chosen, choice.manifest.created_unix))
        return str(choice.chosen), None

    def load(self, info: CheckpointInfo | None = None, *, rank: int | None = None,
             sharded_template: dict | Callable[[dict], dict | None] | None = None,
             check_shared: Callable[[dict], None] | None = None) -> tuple[dict, dict | None, dict | None]:
        """Collective: (shared, this rank's per_rank or None, sharded loaded into the template, or into
        `sharded_template(shared)` where it is a function of the checkpoint's shared state).

        Files are checked against the manifest (sizes, sha256) before they are read; `per_rank` is
        None when the checkpoint was written by fewer ranks than `rank`. `check_shared(shared)` may
        refuse the checkpoint (raise) before the sharded state is read into the template.
        """
        self.wait()
        if info is None:
            info = self.latest()
            if info is None:
                raise CheckpointError(f"no usable checkpoint in {self.directory}; start without resuming")
        rank = self.rank if rank is None else rank
        try:
            manifest = read_manifest(info.path)
        except ValueError as e:
            raise CheckpointError(f"{info.path}: {e}; move it aside to resume from the previous checkpoint") from None
        if sharded_template is not None and not manifest.sharded:
            raise CheckpointError(f"{info.path} holds no sharded state; load it without sharded_template")
        sharded_files = sorted(f.path for f in manifest.files if f.path.startswith(SHARDED_DIR + "/"))
        mine = {SHARED_FILE} | ({rank_file(rank)} if rank < manifest.world_size else set())
        if sharded_template is not None:
            mine |= {p for i, p in enumerate(sharded_files) if i % self.world_size == self.rank}
        reason = check_layout(info.path, manifest, store.step_of(info.path))
        if reason is None and (info.path, manifest.created_unix) not in self._verified:
            reason = verify(info.path, manifest, only=mine)
        reasons = [r for r in self._gather(reason) if r is not None]
        if reasons:
            raise CheckpointError(f"{info.path} failed verification: {'; '.join(sorted(set(reasons)))}; "
                                  f"move it aside to resume from the previous checkpoint")
        shared = read_torch_file(info.path / SHARED_FILE)
        if check_shared is not None:
            check_shared(shared)
        per_rank = read_torch_file(info.path / rank_file(rank)) if rank < manifest.world_size else None
        loaded = None
        if callable(sharded_template):
            sharded_template = sharded_template(shared)
        if sharded_template is not None:
            listed = frozenset(p[len(SHARDED_DIR) + 1:] for p in sharded_files)
            loaded = sharded_io().load_sharded(sharded_template, info.path, self._group, listed)
        return shared, per_rank, loaded

    # ---- the directory ---------------------------------------------------------------------------

    def _hold_directory(self) -> None:
        """Collective: every rank checks it can write the directory, then rank 0 takes its lease."""
        probe = f".probe-{socket.gethostname()}-{os.getpid()}-{self.rank}"
        problem = self._first_error(store.check_directory(self.directory, probe))
        if problem is not None:
            raise CheckpointError(problem)
        key = problem = token = None
        if self.rank == 0:
            try:
                key = lease.hold(self.directory)
                token = lease.holder_of(self.directory).token
            except CheckpointError as e:
                problem = str(e)
        problem, token = self._broadcast((problem, token))
        if problem is not None:
            raise CheckpointError(problem)
        nodes = self._gather(os.environ.get("GROUP_RANK") or socket.gethostname())   # the agent numbers nodes
        if len(set(nodes)) > 1:   # ranks on other nodes must see the lease rank 0 took: one directory for all
            seen, error = lease.seen_within(self.directory, token, SHARED_WAIT_SECONDS)
            problem = self._first_error(None if seen else (
                f"it cannot read the lease rank 0 took in {self.directory} ({error}) within {SHARED_WAIT_SECONDS:.0f} "
                "s" if error else f"it does not see the lease rank 0 took in {self.directory} within "
                f"{SHARED_WAIT_SECONDS:.0f} s: every rank must see one checkpoint directory, on a file system all "
                "nodes share; pass such a path as --checkpoint-dir on every node"))
            if problem is not None:
                if key is not None:
                    lease.let_go(key)
                raise CheckpointError(problem)
        if key is not None:
            self._lease_key = key
            # given back at close(), or when the Checkpointer is dropped or the process exits without close()
            self._release = weakref.finalize(self, lease.let_go, key)
        self._holding = True

    def _let_go(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
        self._holding = False

    # ---- coordination --------------------------------------------------------------------------

    def _first_error(self, error: str | None) -> str | None:
        """Every rank's error (or None) gathered: the first one, so all ranks stop together, naming the rank
        (and how many more failed) when several ranks run."""
        errors = [(r, e) for r, e in enumerate(self._gather(error)) if e is not None]
        if not errors:
            return None
        rank, first = errors[0]
        if self.world_size == 1:
            return first
        more = f" (and {len(errors) - 1} more ranks)" if len(errors) > 1 else ""
        return f"rank {rank}{more}: {first}"

    def _gather(self, obj: Any) -> list:
        if self._group is None:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._group, 0), group=self._group)
        return box[0]


SHARED_WAIT_SECONDS = 65.0
"""How long a rank on another host looks for rank 0's lease file: a network file system may cache a directory's
listing for up to a minute (NFS's acdirmax), so a fresh file can take that long to appear."""


def _coordination_group(process_group: Any) -> Any:
    """A gloo group over the job's ranks for checkpoint coordination (None without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    base = process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(base)
    group = dist.new_group(ranks=ranks, backend="gloo")
    if dist.get_rank(group) < 0:
        raise CheckpointError("this rank is not in the checkpoint's process group; create the Checkpointer "
                              "only on the ranks that train together")
    return group


def _write_error(tmp: Path, rank: int, e: BaseException) -> CheckpointError:
    """A failed write as one line; the fix follows the OS error behind it (torch wraps some in RuntimeError)."""
    cause = os_error_in(e)
    what = describe_os_error(cause) if cause is not None else f"{type(e).__name__}: {e}"
    fix = os_error_fix(cause) if cause is not None else (
        "check that the checkpoint directory is writable and that every rank sees the same one")
    return CheckpointError(f"writing {tmp} failed on rank {rank} ({what}); {fix}")


def _info(path: Path) -> CheckpointInfo:
    try:
        m = read_manifest(path)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; the checkpoint changed while it was being chosen") from None
    return CheckpointInfo(step=m.step, path=path, world_size=m.world_size, sharded=m.sharded, bytes=m.total_bytes)
