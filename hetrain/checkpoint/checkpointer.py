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
"""

from __future__ import annotations

import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetrain.checkpoint import sharded as sharded_io
from hetrain.checkpoint import store
from hetrain.checkpoint.errors import CheckpointError
from hetrain.checkpoint.manifest import FileEntry, Manifest, read_manifest, verify, write_manifest
from hetrain.checkpoint.safe_io import fsync_dir, fsync_file, read_torch_file, sha256_file, snapshot, write_torch_file

SHARED_FILE = "shared.pt"


def rank_file(rank: int) -> str:
    """The name of one rank's own file."""
    return f"rank-{rank:05d}.pt"


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it is damaged or unfinished."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint found on disk."""

    step: int
    path: Path
    world_size: int
    sharded: bool
    bytes: int


class Checkpointer:
    """Saves and loads checkpoints of one job; every rank of the job holds one and calls it together."""

    def __init__(self, directory: str | Path, *, keep: int | None = 3, async_save: bool = True,
                 process_group: Any = None) -> None:
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep={keep}: at least one checkpoint must be kept; pass keep>=1 (None keeps all)")
        self.directory = Path(directory)
        self.keep = keep
        self.async_save = async_save
        self._group = _coordination_group(process_group)
        self.rank = dist.get_rank(self._group) if self._group is not None else 0
        self.world_size = dist.get_world_size(self._group) if self._group is not None else 1
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._verified: set[tuple[Path, float]] = set()
        self._buffers: dict[str, Any] = {}  # host copies reused by background saves
        self._stager = sharded_io.Stager()
        self.last_save_seconds = 0.0
        self.last_blocking_seconds = 0.0
        self.last_bytes = 0
        self.last_path: Path | None = None

    # ---- saving -------------------------------------------------------------------------------

    def save(self, step: int, shared: dict, per_rank: dict, sharded: dict | None = None, *,
             blocking: bool | None = None) -> None:
        """Collective: write one checkpoint of `step` (in the background unless blocking)."""
        start = time.perf_counter()
        self.wait()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step={step!r}: a checkpoint step is an integer >= 0")
        blocking = (not self.async_save) if blocking is None else blocking
        copy = not blocking
        shared_s = per_rank_s = sharded_s = None
        error = None
        try:
            if self.rank == 0:
                shared_s = snapshot(shared, copy=copy, where="shared", buffers=self._buffers if copy else None)
            per_rank_s = snapshot(per_rank, copy=copy, where="per_rank", buffers=self._buffers if copy else None)
            if sharded is not None:
                sharded_s = self._stager.stage(sharded) if copy else sharded
        except CheckpointError as e:
            error = e
        args = (step, shared_s, per_rank_s, sharded_s, sharded is not None, error, start)
        if blocking:
            self._write(*args)
        else:
            self._thread = threading.Thread(target=self._background, args=args, name=f"hetrain-ckpt-{step}",
                                            daemon=True)
            self._thread.start()
        self.last_blocking_seconds = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the background save (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish the pending save."""
        self.wait()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def _write(self, step: int, shared: Any, per_rank: Any, sharded: Any, has_sharded: bool,
               error: BaseException | None, start: float) -> None:
        tmp = store.tmp_dir(self.directory, step)
        if self.rank == 0 and error is None:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = CheckpointError(f"cannot create {tmp} ({e}); check the checkpoint directory is writable")
        first = self._agree(None if error is None else str(error))
        if first is not None:
            self._finish_failed(tmp, error, first)
        entries: list[FileEntry] = []
        try:
            if has_sharded:
                sharded_io.save_sharded(sharded, tmp, self._group)
            if self.rank == 0:
                entries.append(FileEntry(SHARED_FILE, *write_torch_file(shared, tmp / SHARED_FILE)))
            name = rank_file(self.rank)
            entries.append(FileEntry(name, *write_torch_file(per_rank, tmp / name)))
            if has_sharded:
                entries.extend(self._hash_my_share(tmp / sharded_io.SHARDED_DIR))
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            error = e if isinstance(e, CheckpointError) else CheckpointError(
                f"writing {tmp} failed on rank {self.rank} ({type(e).__name__}: {e}); check free space "
                f"and that every rank sees the same checkpoint directory")
        gathered = self._gather((None if error is None else str(error), entries))
        outcome: tuple[str | None, int, str] = (None, 0, "")
        if self.rank == 0:
            outcome = self._commit(step, tmp, gathered, has_sharded)
        outcome = self._broadcast(outcome)
        reason, nbytes, path = outcome
        if reason is not None:
            raise error if error is not None else CheckpointError(reason)
        self.last_bytes = nbytes
        self.last_path = Path(path)
        self.last_save_seconds = time.perf_counter() - start

    def _finish_failed(self, tmp: Path, error: BaseException | None, reason: str) -> None:
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error if error is not None else CheckpointError(reason)

    def _hash_my_share(self, sharded_dir: Path) -> list[FileEntry]:
        """Hash this rank's part of the DCP files (the listing split across ranks)."""
        names = sorted(p.relative_to(sharded_dir).as_posix() for p in sharded_dir.rglob("*") if p.is_file())
        out = []
        for i, name in enumerate(names):
            if i % self.world_size == self.rank:
                fsync_file(sharded_dir / name)
                out.append(FileEntry(f"{sharded_io.SHARDED_DIR}/{name}", *sha256_file(sharded_dir / name)))
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
        try:
            write_manifest(tmp, manifest)
            final = store.commit(self.directory, tmp, step)
            store.prune(self.directory, self.keep)
        except OSError as e:
            return f"committing {tmp} failed ({e}); check the checkpoint directory", 0, ""
        self._verified.add((final, manifest.created_unix))
        return None, manifest.total_bytes, str(final)

    # ---- finding and loading -------------------------------------------------------------------

    def latest(self) -> CheckpointInfo | None:
        """Collective: the newest checkpoint that verifies (rank 0 checks, all ranks get its choice).

        A damaged or unfinished newer checkpoint is reported with a CheckpointWarning naming it.
        """
        self.wait()
        choice = self._find_latest() if self.rank == 0 else None
        choice = self._broadcast(choice)
        if choice is None:
            return None
        return _info(Path(choice))

    def _find_latest(self) -> str | None:
        chosen: Path | None = None
        chosen_step = -1
        for step, path in store.committed(self.directory):
            try:
                manifest = read_manifest(path)
                reason = verify(path, manifest)
                if reason is None and manifest.step != step:
                    reason = f"manifest says step {manifest.step}, the directory says {step}"
            except ValueError as e:
                reason = str(e)
            if reason is None:
                self._verified.add((path, manifest.created_unix))
                chosen, chosen_step = path, step
                break
            warnings.warn(f"checkpoint {path} is unusable: {reason}; trying the previous one",
                          CheckpointWarning, stacklevel=3)
        for entry in sorted(self.directory.glob(f"{store.TMP_PREFIX}*")):
            suffix = entry.name[len(store.TMP_PREFIX):]
            if suffix.isdigit() and int(suffix) > chosen_step:
                warnings.warn(f"{entry} is an unfinished save of step {int(suffix)} and is ignored",
                              CheckpointWarning, stacklevel=3)
        if chosen is None and store.committed(self.directory):
            warnings.warn(f"no usable checkpoint in {self.directory}", CheckpointWarning, stacklevel=3)
        return None if chosen is None else str(chosen)

    def load(self, info: CheckpointInfo | None = None, *, rank: int | None = None,
             sharded_template: dict | None = None) -> tuple[dict, dict | None, dict | None]:
        """Collective: (shared, this rank's per_rank or None, sharded loaded into the template).

        Files are checked against the manifest (sizes, sha256) before they are read; `per_rank` is
        None when the checkpoint was written by fewer ranks than `rank`.
        """
        self.wait()
        if info is None:
            info = self.latest()
            if info is None:
                raise CheckpointError(f"no usable checkpoint in {self.directory}; start without resuming")
        rank = self.rank if rank is None else rank
        manifest = read_manifest(info.path)
        if sharded_template is not None and not manifest.sharded:
            raise CheckpointError(f"{info.path} holds no sharded state; load it without sharded_template")
        mine = {SHARED_FILE} | ({rank_file(rank)} if rank < manifest.world_size else set())
        if sharded_template is not None:
            sharded_files = sorted(f.path for f in manifest.files if f.path.startswith(sharded_io.SHARDED_DIR + "/"))
            mine |= {p for i, p in enumerate(sharded_files) if i % self.world_size == self.rank}
        reason = None
        if (info.path, manifest.created_unix) not in self._verified:
            reason = verify(info.path, manifest, only=mine)
        reasons = [r for r in self._gather(reason) if r is not None]
        if reasons:
            raise CheckpointError(f"{info.path} failed verification: {'; '.join(reasons)}; "
                                  f"move it aside to resume from the previous checkpoint")
        shared = read_torch_file(info.path / SHARED_FILE)
        per_rank = read_torch_file(info.path / rank_file(rank)) if rank < manifest.world_size else None
        loaded = None
        if sharded_template is not None:
            loaded = sharded_io.load_sharded(sharded_template, info.path, self._group)
        return shared, per_rank, loaded

    # ---- coordination --------------------------------------------------------------------------

    def _agree(self, error: str | None) -> str | None:
        """Every rank's error (or None) gathered: the first one, so all ranks stop together."""
        errors = [e for e in self._gather(error) if e is not None]
        return errors[0] if errors else None

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


def _info(path: Path) -> CheckpointInfo:
    try:
        m = read_manifest(path)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}; the checkpoint changed while it was being chosen") from None
    return CheckpointInfo(step=m.step, path=path, world_size=m.world_size, sharded=m.sharded, bytes=m.total_bytes)
