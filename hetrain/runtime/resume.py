"""What a Session saves and restores, and when (docs/design.md, invariant 5).

What a checkpoint holds is a `TrainState` (hetrain.runtime.train_state): everything needed to
continue exactly. Saves happen every `interval` steps, when any rank received
SIGTERM, and when the session closes. A rank's SIGTERM rides in the figures every step sums over
the ranks anyway (items, loss; `hetrain.runtime.gradients`), so every rank sees it at the end of the
same step, the one in flight or the next, and saves that step: no collective of its own per step.

A rank that gets SIGTERM while blocked in a collective (a peer is gone but its connection is not
reset, as when a node drops off the network) cannot run a Python signal handler. A watcher thread,
woken through `signal.set_wakeup_fd`, sees SIGTERM at once; if the rank does not reach the end of
its step within a grace period (the larger of `HETRAIN_SIGTERM_GRACE` seconds, default 5, and three
of its recent steps), it exits with status 143 without saving, so the elastic agent restarts the
job at once instead of after its own SIGKILL timeout.

Sharded state: a ZeroRedundancyOptimizer's state is consolidated on rank 0 and saved whole (it loads
on any number of ranks); an FSDP2 model and its optimizer go through
`torch.distributed.checkpoint.state_dict` into the checkpoint's sharded part, which DCP reshards.

On a different number of ranks (an elastic restart), the global batches continue in the same
order (they depend only on the seed and the global batch size), the split is recomputed for the
new ranks, and a new rank without an RNG state of its own keeps the one it started with.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetrain.checkpoint.checkpointer import Checkpointer
from hetrain.checkpoint.errors import START_FROM_WEIGHTS
from hetrain.errors import HetrainError
from hetrain.runtime.stop_signals import takes_usr1
from hetrain.runtime.environment import env_float, env_int, whole_number
from hetrain.metrics.events import CheckpointRecord
from hetrain.runtime.train_state import TrainState
from hetrain.runtime.watchdog import BETWEEN, INSIDE, READING, ProgressWatch
from hetrain.vocabulary import LOSSY_COMPRESSIONS, Env

log = logging.getLogger("hetrain.checkpoint")

SIGTERM_EXIT = 143
PEER_CHECK_S = 1.0
"""After SIGTERM's grace, how often a rank that has not reached its step's end asks whether every rank still speaks."""
SIGTERM_MAX_WAIT_S = 25.0
"""How long after SIGTERM a rank whose peers all still run waits for its step's end (one question to the
store more at most): under the 30 s `hetrain launch` gives its ranks (HETRAIN_SIGTERM_MAX_WAIT)."""


def checkpoint_settings(directory: str | os.PathLike | None, interval: int | None, keep: int | None,
                        async_save: bool) -> tuple[str | os.PathLike | None, int, int | None, bool]:
    """Session's checkpoint arguments, checked before the process group exists: (directory, interval, keep,
    async_save), the interval from HETRAIN_CHECKPOINT_INTERVAL (default 100) where not given."""
    if interval is None:
        interval = env_int(Env.CHECKPOINT_INTERVAL, 100)
        if interval < 1:
            raise HetrainError(f"{Env.CHECKPOINT_INTERVAL}={interval}: a checkpoint every {interval} steps; set it to "
                               "a whole number >= 1, or unset it (default 100)")
    elif whole_number(interval) is None or interval < 1:
        raise HetrainError(f"checkpoint_interval={interval!r}: pass a whole number of steps >= 1 (None reads "
                           f"{Env.CHECKPOINT_INTERVAL}, default 100; without checkpoint_dir nothing is saved)")
    if keep is not None and (whole_number(keep) is None or keep < 1):
        raise HetrainError(f"keep_checkpoints={keep!r}: at least the newest checkpoint must be kept to resume from it; "
                           "pass keep_checkpoints>=1, or None to keep every checkpoint")
    launched = os.environ.get(Env.CHECKPOINT_DIR) or None
    if directory and launched and env_int("RANK", 0) == 0 and not _inside(directory, launched):
        log.warning("Session(checkpoint_dir=%s) checkpoints there, not in %s (hetrain launch --checkpoint-dir, or "
                    "%s): a restart resumes from the script's directory", directory, launched, Env.CHECKPOINT_DIR)
    directory = directory or launched   # absolute: a script that changes directory saves and resumes where it began
    return (os.path.abspath(os.path.expanduser(directory)) if directory else None, int(interval),
            None if keep is None else int(keep), bool(async_save))


def _inside(directory: str | os.PathLike, parent: str) -> bool:
    """Whether `directory` is `parent` or below it (a GAN's second session's own folder in the job's)."""
    mine, theirs = (os.path.realpath(os.path.expanduser(p)) for p in (directory, parent))
    return mine == theirs or mine.startswith(theirs.rstrip(os.sep) + os.sep)


_WRITTEN: set[str] = set()   # the checkpoint directories sessions of this process have saved to


def start_checkpoints(state: TrainState, settings: tuple, recent_step_seconds: Callable[[], Sequence[float]],
                      on_saved: Callable[[CheckpointRecord], None] | None) -> "SessionCheckpoints | None":
    """A session's checkpoints with `checkpoint_settings(...)` (None without a directory), resumed from the newest
    checkpoint there. A resume that fails (every checkpoint damaged, another model's) gives the directory back
    before the error leaves, so that the script, or a new session, can try again."""
    directory, interval, keep, async_save = settings
    if directory is None:
        return None
    checkpoints = SessionCheckpoints(state, directory, interval=interval, keep=keep, async_save=async_save,
                                     recent_step_seconds=recent_step_seconds, on_saved=on_saved)
    try:
        checkpoints.resume()
    except BaseException:
        checkpoints.close(save=False)
        raise
    return checkpoints


class SessionCheckpoints:
    """Saves a run's TrainState every `interval` steps, on SIGTERM and at close; resumes the newest."""

    def __init__(self, state: TrainState, directory: str | os.PathLike, *, interval: int = 100,
                 keep: int | None = 3, async_save: bool = True,
                 recent_step_seconds: Callable[[], Sequence[float]] = list,
                 on_saved: Callable[[CheckpointRecord], None] | None = None) -> None:
        if interval < 1:
            raise HetrainError(f"checkpoint interval {interval} must be >= 1 step; pass checkpoint_interval>=1")
        self.state = state
        self.interval = interval
        self.recent_step_seconds = recent_step_seconds
        self.on_saved = on_saved
        self.checkpointer = Checkpointer(Path(directory), keep=keep, async_save=async_save)
        self.last_saved_step: int | None = None
        self._saved_end_pending = False   # the last checkpoint left its epoch's end to a resume (data.py)
        self._blocking: dict[int, float] = {}   # step -> seconds its save held the loop, until reported
        self._captured: dict[int, float] = {}   # step -> seconds capturing its state took
        self.resumed_from: int | None = None
        self._sigterm = False
        self._previous_handler = None
        self._previous_usr1 = None
        self._closed_elsewhere = False
        self._forward: dict[int, Any] | None = None   # once closed: signal -> the handler this session replaced
        for other in list(_CLOSED_ELSEWHERE) if threading.current_thread() is threading.main_thread() else ():
            other._restore_signals()   # an earlier session closed from another thread: its signals come back first
        self._watch = _SigtermWatch(self._on_watched_sigterm, self._grace_seconds, self._peers_gone,
                                    self._between_steps)
        self._watch.handler = self._on_sigterm
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: the interval and close() still save
            return
        if takes_usr1():   # a scheduler's warning before the end (Slurm's --signal=USR1@N) would kill it unsaved
            self._previous_usr1 = signal.signal(signal.SIGUSR1, self._on_sigterm)
            self._watch.signals.add(signal.SIGUSR1)
        self._watch.start()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._forward is not None:   # closed: the signal is the script's again (this handler may still be
            self._pass_on(signum, frame)   # installed, closed from another thread, or called by one that chains)
            return
        self._sigterm = True

    def _pass_on(self, signum: int, frame: Any) -> None:
        """A signal after close(): to the handler this session replaced, as if it had never been there. Called by a
        handler of the script's that passes signals on, a default or ignored one is that handler's to act on."""
        delivered = signal.getsignal(signum) == self._on_sigterm   # still installed: the signal came here first
        previous = (self._forward or {}).get(signum)
        if self._closed_elsewhere:
            self._restore_signals()   # in the main thread now: the wakeup fd and the handlers come back
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL and delivered:   # its default action: the process ends
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _on_watched_sigterm(self) -> None:
        self._sigterm = True

    def _between_steps(self) -> str | None:
        """Where this rank is, when not in a step (no batch handed out since its last step), in words."""
        if self.state.loader.step.active:
            return None
        watch, after = ProgressWatch.current, f"after step {self.state.step}"
        phase = watch.phase if watch is not None else None
        if phase == BETWEEN:
            return f"was in the script's own code {after} for"
        if phase is not None and phase.startswith(INSIDE):
            return f"was in {phase[len('in '):]} {after} for"
        return (f"was reading its batch {after} for" if phase == READING else
                f"was between steps ({after}: in the script's own code, or reading its next batch) for")

    def _peers_gone(self) -> list[int] | None:
        """The ranks the job's progress watch sees gone or frozen ([] when every one still speaks: none for
        one rank), or None when nothing can tell: no watch to ask (a process group the script started
        itself), or a store that does not answer (its host is gone). A rank counts as frozen when its entry
        did not move for the grace period (a rank holding the interpreter lock in a long C call is not)."""
        if self.state.world_size == 1:
            return []
        watch = ProgressWatch.current
        if watch is None:
            return None
        window = max(self._grace_seconds(), 3 * watch.interval_s)
        answer: list[list[int] | None] = []

        def ask() -> None:
            try:
                answer.append(watch.silent_peers(window))
            except Exception:  # the store is gone: so is the job
                answer.append(None)

        asking = threading.Thread(target=ask, name="hetrain-sigterm-peers", daemon=True)
        asking.start()
        asking.join(window + 2 * watch.interval_s)   # a store whose host froze answers no read
        return answer[0] if answer else None

    def _grace_seconds(self) -> float:
        """How long a rank may take to reach the end of its step after SIGTERM before it exits unsaved."""
        floor = env_float(Env.SIGTERM_GRACE, 5.0)
        recent = list(self.recent_step_seconds())[-20:]
        return max(floor, 3 * max(recent)) if recent else floor

    # -- saving -----------------------------------------------------------------------------------

    def save(self, *, blocking: bool | None = None, in_step: bool = False) -> None:
        """Collective: write a checkpoint of the current step (`in_step`: from inside `session.step()`)."""
        start = time.perf_counter()
        shared, per_rank, sharded = self.state.capture(in_step=in_step)
        self._captured[self.state.step] = time.perf_counter() - start   # part of the save's time until committed
        self.checkpointer.save(self.state.step, shared, per_rank, sharded, blocking=blocking)
        self.last_saved_step = self.state.step
        _WRITTEN.add(os.path.realpath(self.checkpointer.directory))
        self._saved_end_pending = bool(shared["loader"].get("epoch_end_pending"))
        self._blocking[self.state.step] = time.perf_counter() - start   # the loop held: capture, then the save
        self._report_committed()

    def _report_committed(self) -> None:
        """One CheckpointRecord per checkpoint committed since the last report: a background save's
        is known once it is on disk (its size and save time are its own, not the previous one's)."""
        for step, total, nbytes in self.checkpointer.take_committed():
            blocking, captured = self._blocking.pop(step, 0.0), self._captured.pop(step, 0.0)
            if self.on_saved is not None:   # until committed: from the capture of the state on
                self.on_saved(CheckpointRecord(step, blocking, captured + total, nbytes))

    @property
    def stop_requested(self) -> bool:
        """This rank received SIGTERM: the next step's figures carry it to every rank."""
        return self._sigterm

    def after_step(self, stop: bool = False) -> None:
        """Called at the end of every step: save on the interval, or save and stop when `stop` (the
        step's figures, summed over the ranks, say some rank received SIGTERM before they left it;
        every rank has the same figures, so every rank saves this step)."""
        self._report_committed()
        if stop:
            self._watch.reached()  # every rank is here: the save can proceed
            if self.state.rank == 0:   # every rank saves it: said once
                log.warning("SIGTERM: saving step %d and stopping", self.state.step)
            self.save(blocking=True, in_step=True)
            self.checkpointer.close()
            self._restore_signals()
            raise SystemExit(SIGTERM_EXIT)
        if self.state.step % self.interval == 0:
            self.save(in_step=True)

    def close(self, save: bool = True) -> None:
        """Save the last step (unless saved already, or not `save`), finish pending saves, restore the SIGTERM
        handler."""
        self._watch.reached()
        # an error at an epoch's end: that step's state with part of what the script does there, which a resume
        # from the step's own checkpoint (taken inside it) does again
        erred_at_epoch_end = sys.exc_info()[0] not in (None, SystemExit) and self.state.loader.step_in_epoch == 0
        # the last checkpoint, of this step, left the epoch's end to a resume, and a save now would not (the loop
        # has gone past that end, its pass ended; the loader's own test): saved again, so that a run launched again
        # does not run that end again
        past_end = (self._saved_end_pending and self.last_saved_step == self.state.step
                    and not self.state.loader.state_dict(in_step=True)["epoch_end_pending"])
        wanted = save and (self.last_saved_step != self.state.step or past_end) and self.state.step > 0 \
            and not erred_at_epoch_end
        if wanted and not dist.is_initialized():   # the script's destroy_process_group() came first
            log.warning("no checkpoint of step %d at close: the process group was destroyed before session.close() "
                        "(the last checkpoint is step %s); close the session before dist.destroy_process_group()",
                        self.state.step, self.last_saved_step)
            wanted = False
        try:
            if wanted:
                self.save(blocking=True)
            self.checkpointer.close()
            self._report_committed()
        finally:
            self._restore_signals()

    def _restore_signals(self) -> None:
        """The handlers this session replaced, where its own is still in place (not one the script set since).
        Only the main thread can set them: closed from another thread, they come back when the session's handler
        next runs (in the main thread) or the next session starts."""
        if self._forward is None:
            usr1 = getattr(signal, "SIGUSR1", None)
            self._forward = {int(sig): previous for sig, previous in ((signal.SIGTERM, self._previous_handler),
                                                                    (usr1, self._previous_usr1))
                             if sig is not None and previous is not None}
        self._watch.stop()
        if threading.current_thread() is not threading.main_thread() and \
                (self._watch.holds_wakeup_fd or self._previous_handler is not None or self._previous_usr1 is not None):
            if not self._closed_elsewhere:
                _CLOSED_ELSEWHERE.append(self)
                self._closed_elsewhere = True
            return
        if self._closed_elsewhere:
            self._closed_elsewhere = False
            if self in _CLOSED_ELSEWHERE:
                _CLOSED_ELSEWHERE.remove(self)
        for sig, previous in ((signal.SIGTERM, self._previous_handler), (getattr(signal, "SIGUSR1", None),
                                                                          self._previous_usr1)):
            if previous is not None and signal.getsignal(sig) == self._on_sigterm:
                try:
                    signal.signal(sig, previous)
                except ValueError:
                    pass
        self._previous_handler = self._previous_usr1 = None

    # -- resume -----------------------------------------------------------------------------------

    def resume(self) -> bool:
        """Restore the newest good checkpoint, if there is one; True when the run resumed."""
        info = self.checkpointer.latest()
        if info is None:
            return False
        st = self.state
        if st.fsdp != info.sharded:
            saved = ("by a pipeline plan or with FSDP2 (its model in sharded form)" if info.sharded
                     else "by a data-parallel run without FSDP2 (its model whole)")
            this = "a pipeline plan" if st.pipelined else f"sharding {st.sharding!r}"
            raise HetrainError(
                f"{info.path} was saved {saved}, and this run uses {this}, which cannot load it; resume with "
                f"the kind of plan it was saved with, or {START_FROM_WEIGHTS}"
            )
        def same_layout(shared: dict) -> None:
            """A pipeline's stage state and FSDP2's shards are both sharded, but not into the same keys."""
            saved_plan = shared.get("plan") or ""   # read as JSON: a plan a later schema refuses still tells this
            saved_pipeline = bool(saved_plan) and json.loads(saved_plan).get("pipeline") is not None
            if saved_pipeline != st.pipelined:
                saved = "by a pipeline plan" if saved_pipeline else f"with sharding {shared.get('sharding')!r}"
                this = "a pipeline plan" if st.pipelined else f"sharding {st.sharding!r}"
                raise HetrainError(
                    f"{info.path} was saved {saved}, and this run uses {this}, which cannot load it; resume "
                    f"with the kind of plan it was saved with, or {START_FROM_WEIGHTS}")
            st.check_model_keys(shared, str(info.path))

        # FSDP2's template is built once the checkpoint's shared state says which parameters have optimizer state
        shared, per_rank, loaded = self.checkpointer.load(info, sharded_template=st.sharded_template if st.fsdp else
                                                          None, check_shared=same_layout)
        saved_world = int(shared["world_size"])
        st.restore(shared, per_rank, loaded, str(info.path))
        lossy = st.plan.comm.compression if st.plan is not None else "none"
        if lossy in LOSSY_COMPRESSIONS and st.rank == 0:
            log.warning("the plan's %s compression starts the error each rank carries anew after a resume (it is not "
                        "checkpointed): the run continues near, not exactly on, an uninterrupted one", lossy)
        if saved_world != st.world_size and st.rank == 0:   # job-wide: said once, not by each of its ranks
            log.warning("resuming a %d-rank checkpoint on %d ranks: the global batches continue in order, "
                        "the split is recomputed (%s)", saved_world, st.world_size, st.balancer.shares)
        self.resumed_from = st.step
        self.last_saved_step = st.step
        self._saved_end_pending = bool(shared["loader"].get("epoch_end_pending"))
        log.info("resumed from %s (step %d, epoch %d, step in epoch %d)", info.path, st.step,
                 st.loader.epoch, st.loader.step_in_epoch)
        if os.path.realpath(self.checkpointer.directory) in _WRITTEN and st.rank == 0:
            log.warning("resumed from %s, which an earlier session of this process saved: this session continues that "
                        "one's model (a sweep's next trial would go on from the last trial's); give each trial a "
                        "checkpoint_dir of its own (hetrain.Session(checkpoint_dir=...))", info.path)
        return True


_CLOSED_ELSEWHERE: list[SessionCheckpoints] = []   # closed from a thread other than the main one, signals not yet back


class _SigtermWatch:
    """A thread that sees SIGTERM at once (through the signal wakeup fd), even while the main thread is
    blocked in a collective, and exits the process if the main thread has not reached the save within its
    grace and a rank it may wait on is gone or frozen (or nothing can tell: no progress watch). While
    every rank still speaks (an evaluation, a slow loader start), the save waits for the step's end."""

    def __init__(self, on_sigterm: Any, grace: Any, peers_gone: Any, between_steps: Any = lambda: None) -> None:
        self._on_sigterm = on_sigterm
        self._between_steps = between_steps
        self.signals = {int(signal.SIGTERM)}   # and SIGUSR1 where the session took it
        self.handler: Any = None   # the session's: SIGUSR1 counts while it is SIGUSR1's handler
        self._grace = grace
        self._peers_gone = peers_gone
        self._reached = threading.Event()
        self._stopped = False
        self._fds: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen on the wakeup fd (main thread only); left off when another listener (an event loop) has it."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            return
        self._fds = (r, w)
        self._thread = threading.Thread(target=self._run, name="hetrain-sigterm", daemon=True)
        self._thread.start()

    @property
    def holds_wakeup_fd(self) -> bool:
        """Whether its pipe is still the signal wakeup fd (set in the main thread; only that thread resets it)."""
        return self._fds is not None

    def reached(self) -> None:
        """The main thread is at the save point (or closing): no early exit from here on."""
        self._reached.set()

    def stop(self) -> None:
        if self._fds is None:
            return
        r, w = self._fds
        if not self._stopped:
            self._stopped = True
            self._reached.set()
            os.write(w, b"\0")
            if self._thread is not None:
                self._thread.join(timeout=5)
        try:
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, w):  # someone replaced ours meanwhile: leave theirs
                signal.set_wakeup_fd(current)
        except ValueError:  # not the main thread: the wakeup fd stays ours, so its pipe stays open until stop()
            return          # is called again from the main thread (a closed fd's number is soon another file's)
        os.close(r)
        os.close(w)
        self._fds = None

    def _run(self) -> None:
        r = self._fds[0]
        while not self._stopped:
            data = os.read(r, 64)
            if self._stopped or not data:
                return
            # SIGTERM always (a script's own handler may chain to the session's, which cannot run while the main
            # thread is blocked); SIGUSR1 while the session's handler is its handler (a script may take it back)
            if not any(sig == signal.SIGTERM or signal.getsignal(sig) == self.handler
                       for sig in self.signals.intersection(data)):
                continue
            self._on_sigterm()
            started = time.monotonic()
            if self._reached.wait(self._grace()) or self._stopped:
                return
            most = env_float(Env.SIGTERM_MAX_WAIT, SIGTERM_MAX_WAIT_S)
            gone = self._peers_gone()
            while gone == [] and time.monotonic() - started < most:
                # every rank still speaks (an evaluation, a slow loader start): the step's end comes
                if self._reached.wait(PEER_CHECK_S) or self._stopped:
                    return
                gone = self._peers_gone()
            if self._reached.is_set() or self._stopped:   # the save began while the peers were asked about
                return
            why = (f"rank(s) {', '.join(map(str, gone))} gone or frozen" if gone
                   else f"every rank still ran after {most:g} s ({Env.SIGTERM_MAX_WAIT})" if gone == []
                   else "blocked in a collective with a rank that is gone?")
            where = self._between_steps() or "did not reach the end of its step within"   # work after the loop
            log.warning("SIGTERM: rank %s %s %.1f s (%s); exiting without saving, the last checkpoint stays",
                        os.environ.get("RANK", "0"), where, time.monotonic() - started, why)
            logging.shutdown()
            from hetrain.checkpoint.lease import release_all

            release_all()
            os._exit(SIGTERM_EXIT)
