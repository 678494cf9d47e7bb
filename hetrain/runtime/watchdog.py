"""Nothing silent: a rank ends with its launcher, a stalled rank is named, and a failure is recorded.

- a worker dies with its launcher: `hetrain.runtime.parent_death`.
- why a rank ends, for the launcher to name the rank that failed first: `hetrain.runtime.failure_record`.
- `ProgressWatch`: each rank publishes (step, phase) to the job's c10d store; a rank that sees no
  progress of its own for `timeout_s` reads every rank's entry, finds the rank the others wait on,
  and one rank prints `hetrain: error: rank R made no progress at step S for T s (...)` and ends
  its process, so the agent stops (or restarts) the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Callable

from hetrain.errors import ranks_text
from hetrain.runtime.failure_record import one_line, record_failure

STALL_EXIT = 124
"""Exit status of a rank that ends a stalled job (as coreutils' `timeout`)."""

# ---- progress watch ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """One rank's published state: its step, its phase, how long it has been in that phase."""

    step: int
    phase: str
    """"computing" (its own work in a step), BETWEEN (the script's own code after a step), READING (drawing
    its batch), "waiting" (on the others), INSIDE a collective call, or "done" (its watch stopped)"""
    seconds: float
    seq: int
    """publish count: a rank whose seq stops moving cannot speak (frozen, or holding the GIL)"""


@dataclass(frozen=True)
class Stall:
    """Who made no progress, where, and who reports it."""

    culprits: list[int]
    step: int
    reporter: int
    silent: list[int]


INSIDE = "in session."   # the phase of a rank inside a collective call of the session
BETWEEN = "in the script's own code between steps"
READING = "reading its batch"
STREAM_ENDED = "its stream ended"   # after a pass, until every rank begins the next
DONE = "done"
FORK_CAN_HANG = sys.version_info < (3, 12)
"""CPython before 3.12 can deadlock a child forked while another thread of the parent makes a Python thread
state, as gloo's threads do (python/cpython#112275): a DataLoader worker forked from a rank."""
ERRED = "left on an error: "   # after DONE's ": ", then the error's one line
BARRIER = f"{INSIDE}barrier()"
IN_A_STEP = ("waiting", "computing")   # a rank in a step, which needs every rank to end


def own_code(phase: str) -> bool:
    """The script's own code or its data: between steps, reading a batch, after a stream's pass ended."""
    return phase in (BETWEEN, READING) or phase.startswith(STREAM_ENDED)


def busy(phase: str) -> bool:
    """A rank's own work, which the others wait on."""
    return phase == "computing" or own_code(phase)


def is_done(phase: str) -> bool:
    """Whether a published phase is a closed session's ("done", or "done: " and what it did last)."""
    return phase == DONE or phase.startswith(DONE + ": ")


def collective_call(watch: "ProgressWatch | None", call: str) -> Any:
    """`watch.inside(call)` (the process's running watch when None is given), or nothing without one."""
    watch = watch or ProgressWatch.current
    return contextlib.nullcontext() if watch is None else watch.inside(call)


def find_stall(before: dict[int, Progress | None], after: dict[int, Progress | None]) -> Stall:
    """Decide, from two reads of every rank's entry taken a little apart, who holds the job up.

    Culprits: the ranks at the lowest step, those still computing there if any (the others wait
    on them). A rank whose entry did not change between the reads (or never appeared) is silent.
    The report comes from the lowest culprit that can speak, else the lowest rank that can.
    """
    silent = sorted(r for r, p in after.items()
                    if p is None or (not is_done(p.phase) and before.get(r) is not None and before[r].seq == p.seq))
    known = {r: p for r, p in after.items() if p is not None}
    missing = sorted(r for r, p in after.items() if p is None)
    if missing:
        culprits = missing
    else:
        low = min(p.step for p in known.values())
        lowest = sorted(r for r, p in known.items() if p.step == low)
        # the script's own code (or its data) before its forward, ahead of a forward whose FSDP2 gathers wait on it
        culprits = [r for r in lowest if own_code(known[r].phase)] or \
            [r for r in lowest if busy(known[r].phase)] or lowest
    # A silent rank may have moved on since it last spoke, but not past a step the others wait in.
    waiting = [p.step for r, p in known.items() if r not in culprits and not busy(p.phase)]
    published = [known[r].step for r in culprits if r in known]
    step = max(published + ([min(waiting)] if waiting else []), default=0)
    speaking = [r for r in sorted(after) if r not in silent]
    reporter = next((r for r in culprits if r in speaking), speaking[0] if speaking else min(after))
    return Stall(culprits, step, reporter, silent)


FORKED_WORKER = (f"; on Python {sys.version_info[0]}.{sys.version_info[1]} a worker forked from a rank can hang before "
                 "it runs (python/cpython#112275, fixed in 3.12): multiprocessing_context=\"forkserver\" in "
                 "session.loader(...) starts workers without forking the rank (the script's training code then sits "
                 "under `if __name__ == \"__main__\":`)")


def stall_message(stall: Stall, after: dict[int, Progress | None], own_seconds: float, timeout_s: float) -> str:
    """The one line a stall report prints (without the `hetrain: error: ` prefix)."""
    early = ended_early(after)
    if early is not None:
        return early + f" (limit {timeout_s:g} s, hetrain launch --collective-timeout)"
    calls = {r: p.phase[len(INSIDE):] for r, p in after.items() if p is not None and p.phase.startswith(INSIDE)}
    done = sorted(r for r, p in after.items() if p is not None and is_done(p.phase))
    if calls and done and len(calls) + len(done) == len(after):   # `if rank == 0: session.model_state_dict()` at the end
        erred = [after[r].phase.split(ERRED, 1)[1] for r in done if ERRED in after[r].phase]
        how = f"left the session on an error ({'; '.join(erred)})" if erred else "closed the session"
        in_loops = any(f"{INSIDE}{c}" in ENDS_TOGETHER for c in calls.values())   # not model_state_dict()
        why = "every rank makes (let the error end the script, rather than catch it and go on" if erred else \
            ("every rank makes as many times before close() (is it inside `if rank == 0:`, or in a loop over each "
             "rank's own part of a set, whose batches differ in number by rank? pad every rank's part to one count "
             "of batches, or gather once after the loop" if in_loops else
             "every rank makes before close() (is it inside `if rank == 0:`?")
        return (f"{ranks_text(done)} {how} while {ranks_text(sorted(calls))} wait(s) in session."
                f"{', session.'.join(sorted(set(calls.values())))} for {own_seconds:.0f} s: a collective call {why}; "
                f"limit {timeout_s:g} s, hetrain launch --collective-timeout)")
    stepping = sorted(r for r, p in after.items() if p is not None and p.phase == "waiting")
    # `if rank == 0: session.barrier()`: the others wait in their step (a rank that stopped speaking is named below)
    if calls and stepping and len(calls) + len(stepping) == len(after) and not set(stepping) & set(stall.silent):
        return (f"{ranks_text(sorted(calls))} wait(s) in session.{', session.'.join(sorted(set(calls.values())))} "
                f"while {ranks_text(stepping)} wait(s) in step {stall.step} for {own_seconds:.0f} s: a collective "
                f"call every rank makes at the same point of its loop (is it inside `if rank == 0:`?; limit "
                f"{timeout_s:g} s, hetrain launch --collective-timeout)")
    if len(calls) == len(after) and len(set(calls.values())) > 1:   # e.g. session.barrier() inside `if rank == 0:`
        where = "; ".join(f"{ranks_text(sorted(r for r in calls if calls[r] == c))} in session.{c}"
                          for c in sorted(set(calls.values())))
        return (f"the ranks wait in different collective calls at step {stall.step} for {own_seconds:.0f} s ({where}): "
                f"every rank makes the session's collective calls in one order (is one inside `if rank == 0:`?; "
                f"limit {timeout_s:g} s, hetrain launch --collective-timeout)")
    first = stall.culprits[0]
    entry = after.get(first)
    seconds = own_seconds if entry is None or first in stall.silent else max(entry.seconds, own_seconds)
    who = ranks_text(stall.culprits)
    waiting = [r for r, p in after.items() if p is not None and r not in stall.culprits]
    if entry is None:
        doing = "it never reported"
    elif first in stall.silent:
        doing = f"it stopped responding while {entry.phase}"
    else:
        doing = f"{entry.phase}"
    inside = {r: after[r].phase[len("in "):] for r in waiting if after[r].phase.startswith(INSIDE)}
    plain = [r for r in waiting if r not in inside]
    others = f"; {ranks_text(sorted(plain))} wait{'s' if len(plain) == 1 else ''} on it" if plain else ""
    for call in sorted(set(inside.values())):   # e.g. `if rank == 0: session.model_state_dict()` under FSDP2
        ranks = sorted(r for r, c in inside.items() if c == call)
        others += (f"; {ranks_text(ranks)} wait{'s' if len(ranks) == 1 else ''} on it in {call}, a collective call "
                   "every rank must make")
    compiling = " (torch.compile's compile and recompiles count as computing)" if doing == "computing" else \
        (" (an evaluation, a save or a download on this rank alone? ranks that wait for it call session.barrier(); "
         "or a collective of the script's own that the other ranks do not call, a dist.barrier() inside `if rank == "
         "0:`; under FSDP2 or a pipeline every rank takes part in every forward)" if doing == BETWEEN else
         f" (a DataLoader worker or the dataset stalled{FORKED_WORKER if FORK_CAN_HANG else ''})" if doing == READING
         else "")
    return (f"{who} made no progress at step {stall.step} for {seconds:.0f} s ({doing}{others}; "
            f"limit {timeout_s:g} s, hetrain launch --collective-timeout{compiling})")


def ended_early(after: dict[int, Progress | None]) -> str | None:
    """When ranks closed their sessions, or their streams ended a pass, while others wait in a step the
    ended ones never took (a loop that stops after a count of batches, which micro-batches make differ
    between ranks; streams of different lengths): the cause, in words. A closed rank publishes the
    step after its last one."""
    ended = {r: p for r, p in after.items() if p is not None and (is_done(p.phase) or p.phase.startswith(STREAM_ENDED))}
    if not ended:
        return None
    erred = {r: p.phase[len(f"{DONE}: {ERRED}"):] for r, p in ended.items() if p.phase.startswith(f"{DONE}: {ERRED}")}
    first_untaken = min(p.step for p in ended.values())
    # a rank in a step a closed one never takes waits in vain there, computing or not: its step's collectives (the
    # first backward's agreement, DDP's bucket rebuild) need every rank; a stream's ranks are near a pass's start
    streams = {r: p.phase.split(STREAM_ENDED, 1)[1] for r, p in ended.items() if STREAM_ENDED in p.phase and r not in erred}
    phases = ("waiting",) if streams else IN_A_STEP
    ahead = {r: p for r, p in after.items() if p is not None and p.phase in phases and p.step >= first_untaken}
    if not ahead:
        return None
    closed, last, waiting = sorted(ended), first_untaken - 1, sorted(ahead)
    step = min(ahead[r].step for r in waiting)
    if erred:   # the script caught the error and went on (or is still on its way out)
        what = "; ".join(f"{ranks_text([r])} left the session on an error ({erred[r]})" for r in sorted(erred))
        return (f"{what} after {last} step(s), while {ranks_text(waiting)} wait(s) in step {step}, which every rank "
                "must take: let the error end the script, so that the launcher stops or restarts the job, rather "
                "than catch it and go on (its output has the traceback)")
    if streams:
        what = "; ".join(f"{ranks_text([r])}'s stream ended{streams[r]}" for r in sorted(streams))
        return (f"{what}, while {ranks_text(waiting)} wait(s) in step {step} for more: every rank reads the "
                "whole stream and takes its share, so every rank's stream must yield the same samples in the "
                "same order (a fixed shard list and seed, not split by rank; docs/data.md)")
    return (f"{ranks_text(closed)} closed the session after {last} "
            f"step(s) while {ranks_text(waiting)} wait(s) in step "
            f"{step}: every rank must take the same steps; end the loop on session.step_count or the loader's "
            "epoch, not on a count of batches (micro-batches make that count differ between ranks), and call "
            "session.backward() and step() on every batch, an empty one too (a `continue` past it skips the step)")


ENDS_TOGETHER = tuple(f"{INSIDE}{call}()" for call in ("gather_rows", "global_mean", "barrier"))
"""Calls that end on every rank at once (an all-gather, an all-reduce, a meeting): a rank still in one after
another closed waits in vain. Not model_state_dict(), whose rank 0 may work on after the others return."""

CLOSED_KEY = "hetrain/progress/closed"
"""Set by a rank that closes its session: ranks still waiting check whether they wait in vain."""


class ProgressWatch:
    """Publishes this rank's progress to the store and ends the job, naming the culprit, on a stall.

    Call `computing(step)` when the rank's own work on `step` begins and `waiting(step)` when it
    starts waiting on the others (gradients ready, end-of-step sync). Keys are `hetrain/progress/R`
    of the store given (a PrefixStore per attempt keeps restarts apart).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, *, interval_s: float = 1.0,
                 on_stall: Callable[[str, Stall], None] | None = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = float(timeout_s)
        self.interval_s = min(interval_s, self.timeout_s / 4)
        self.on_stall = on_stall or _report_and_exit
        self._step, self._phase = 0, BETWEEN
        self._since = time.monotonic()
        self._seq = 0
        self._seen: dict[int, Progress | None] | None = None   # the last read of every rank's entry while waiting
        self._closed_seen: list[int] | None = None   # the closed ranks a check in a call that ends together saw
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    current: "ProgressWatch | None" = None   # the process's running watch

    def start(self) -> None:
        """Publish the first entry and start the watching thread."""
        ProgressWatch.current = self
        self._publish()
        self._thread = threading.Thread(target=self._run, name="hetrain-progress-watch", daemon=True)
        self._thread.start()

    def computing(self, step: int) -> None:
        self._set(step, "computing")

    step = property(lambda self: self._step)
    phase = property(lambda self: self._phase)

    def between(self, step: int) -> None:
        self._set(step, BETWEEN)

    def reading(self, step: int) -> None:
        if not self._phase.startswith(STREAM_ENDED):   # the next pass's first batch: the ended pass stays said
            self._set(step, READING)

    def waiting(self, step: int) -> None:
        self._set(step, "waiting")

    def stream_end(self, ended: tuple[int, int] | None, step: int) -> None:
        """This rank's stream ended a pass, `(epoch, global batches read)`, before `step` (ranks waiting in a
        step this one never takes name it at once); or (None) every rank began the next pass."""
        if ended is not None:
            self._set(step, f"{STREAM_ENDED} after {ended[1]} global batch(es) of epoch {ended[0]}")
            try:
                self.store.set(CLOSED_KEY, "1")
            except Exception:  # the store is gone: the job is over
                pass
        elif self._phase.startswith(STREAM_ENDED):
            self._set(self._step, "computing")

    @contextlib.contextmanager
    def inside(self, call: str) -> Iterator[None]:
        """While the rank is in one of the session's collective calls (`call`, e.g. "model_state_dict"): a stall
        there names the call, which every rank must make."""
        step, phase = self._step, self._phase
        self._set(step, f"{INSIDE}{call}()")
        try:
            yield
        finally:
            self._set(step, phase)

    def stop(self, error: BaseException | None = None) -> None:
        """Stop watching and say so in the store, so that ranks still watching do not take this one for silent;
        `error`: what ended the session, when it is left on an error, which a rank waiting for it is told."""
        self._stop.set()
        if ProgressWatch.current is self:
            ProgressWatch.current = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s)
        self._phase = f"{DONE}: {ERRED}{_said(error)}" if error is not None else \
            f"{DONE}: {self._phase}" if self._phase.startswith(STREAM_ENDED) else DONE
        try:
            self._publish()
            self.store.set(CLOSED_KEY, "1")   # ranks still waiting look for a step this one never takes
        except Exception:  # the store is gone: the job is over
            pass

    def silent_peers(self, window_s: float) -> list[int]:
        """The other ranks whose entry did not move over `window_s` seconds (gone, stopped, or holding the
        interpreter lock all that time) and who have not closed: ranks that cannot be counted on to reach
        the end of the step. A closed rank is not among them: it waits in its final save, and a rank
        that waits for it in a step is named by this watch's own check (`_closed_early`)."""
        before = self._read_all()
        time.sleep(window_s)
        after = self._read_all()
        return [r for r, p in after.items() if r != self.rank and (p is None or before[r] is None or
                                                                   (p.seq == before[r].seq and not is_done(p.phase)))]

    def _set(self, step: int, phase: str) -> None:
        if (step, phase) != (self._step, self._phase):
            self._step, self._phase, self._since = step, phase, time.monotonic()

    def _key(self, rank: int) -> str:
        return f"hetrain/progress/{rank}"

    def _publish(self) -> None:
        self._seq += 1
        value = json.dumps({"step": self._step, "phase": self._phase,
                            "seconds": round(time.monotonic() - self._since, 3), "seq": self._seq})
        self.store.set(self._key(self.rank), value)

    def _read_all(self) -> dict[int, Progress | None]:
        out: dict[int, Progress | None] = {}
        for r in range(self.world_size):
            key = self._key(r)
            if not self.store.check([key]):  # get() would block until the key appears
                out[r] = None
                continue
            raw = json.loads(self.store.get(key))
            out[r] = Progress(int(raw["step"]), str(raw["phase"]), float(raw["seconds"]), int(raw["seq"]))
        return out

    def _run(self) -> None:
        before: dict[int, Progress | None] | None = None
        before_at = reported_at = 0.0
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
                now = time.monotonic()
                stalled = now - self._since
                if self._closed_early(stalled) or self._call_after_close(stalled):
                    return
                if stalled < self.timeout_s - 3 * self.interval_s:
                    before, reported_at = None, 0.0
                    continue
                if before is None:  # a first read, to tell ranks that still speak from silent ones
                    before, before_at = self._read_all(), now
                    continue
                if stalled < self.timeout_s or now - before_at < 2.5 * self.interval_s:
                    continue
                after = self._read_all()
                stall = find_stall(before, after)
                if waits_on_work_before_a_barrier(stall, after):
                    before, reported_at = None, 0.0
                    continue
                # Another rank reports; if the job still stands a few intervals later, this one does.
                late = reported_at and now - reported_at > 5 * self.interval_s
                if stall.reporter == self.rank or late:
                    self.on_stall(stall_message(stall, after, stalled, self.timeout_s), stall)
                    return
                reported_at = reported_at or now
            except Exception:  # the store went away (the agent is gone): nothing left to watch
                if self._stop.is_set():
                    return
                time.sleep(self.interval_s)


    def _closed_early(self, stalled: float) -> bool:
        """Waiting in a step a rank that closed its session never takes: the lowest such rank reports
        it now (the others end with the job), without waiting for the progress timeout."""
        if self._phase not in IN_A_STEP or stalled < 3 * self.interval_s or not self.store.check([CLOSED_KEY]):
            return False
        after = self._read_all()
        early = ended_early(after)
        waiting = sorted(r for r, p in after.items() if p is not None and p.phase in IN_A_STEP)
        seen, self._seen = self._seen, after
        if early is None or not waiting or waiting[0] != self.rank:
            return False
        # a rank whose stream ended must still say so at a later publish (it did not just begin the next pass)
        streams = [r for r, p in after.items() if p is not None and p.phase.startswith(STREAM_ENDED)]
        if any(seen is None or seen.get(r) is None or seen[r].seq >= after[r].seq or seen[r].phase != after[r].phase
               for r in streams):
            return False
        self.on_stall(early, find_stall(after, after))
        return True

    def _call_after_close(self, stalled: float) -> bool:
        """In a call every rank ends at once (session.gather_rows() in an evaluation loop whose ranks have
        different numbers of batches) while the others closed their sessions or wait in such calls: the rank
        waits in vain. Said at the second check that sees it (a rank that closed right after the call's end has
        let this one out by then), by the lowest rank in the call, without waiting for the progress timeout."""
        if self._phase not in ENDS_TOGETHER or stalled < 3 * self.interval_s or not self.store.check([CLOSED_KEY]):
            self._closed_seen = None
            return False
        after = self._read_all()
        done = sorted(r for r, p in after.items() if p is not None and is_done(p.phase))
        calls = sorted(r for r, p in after.items() if p is not None and p.phase in ENDS_TOGETHER)
        seen, self._closed_seen = self._closed_seen, done
        if not done or len(done) + len(calls) != len(after) or calls[0] != self.rank or seen != done:
            return False
        stall = find_stall(after, after)
        self.on_stall(stall_message(stall, after, stalled, self.timeout_s), stall)
        return True


def _said(error: BaseException) -> str:
    """`one_line(error)`, or its type where its message cannot be made (a __str__ that raises)."""
    try:
        return one_line(error)
    except Exception:
        return type(error).__name__


def waits_on_work_before_a_barrier(stall: Stall, after: dict[int, Progress | None]) -> bool:
    """Every rank the culprits hold up waits in `session.barrier()`, and the culprits are in the script's own
    code and still speak: its work before the barrier (a download on rank 0), as long as it takes. A culprit
    that stopped publishing (frozen), reading a batch (a stalled dataset) or in a step is named as ever."""
    others = [p for r, p in after.items() if r not in stall.culprits]
    return bool(others) and all(p is not None and p.phase == BARRIER for p in others) and \
        all(after.get(r) is not None and r not in stall.silent and own_code(after[r].phase) and
            after[r].phase != READING for r in stall.culprits)


def _report_and_exit(message: str, stall: Stall) -> None:
    """Print the stall's one line, record it for the launcher, and end this rank at once."""
    blame = stall.culprits[0] if len(stall.culprits) == 1 else None
    record_failure(message, blame=blame)
    sys.stderr.write(f"hetrain: error: {message}\n")   # one write: ranks' lines never run together
    sys.stderr.flush()
    os._exit(STALL_EXIT)
