"""Sessions open in one process. A script that trains two models on one batch, each with its own session (a
GAN's generator and discriminator, each with its optimizer), has two balancers that would each re-split on its
own timings: their splits part, and a batch one session cut weighs wrongly in the other (a rank computes the
generator's loss on the discriminator's 20 samples while the generator's session weighs it as 21 of 32). A
session's loader made while a companion session reads global batches of the same size takes that session's
split, step by step: the first one's balancer measures and re-splits both.

Companions are sessions made side by side: one that had drawn no batch when the other was made. A session a
script left open after an error (a notebook cell re-run) has drawn batches by the time its successor is made, so
the new session neither follows its split nor is refused its checkpoint directory."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from hetrain.errors import HetrainError

log = logging.getLogger("hetrain")

_open: list[tuple[weakref.ref, list[weakref.ref]]] = []   # (session, the sessions that had drawn none when it was made)


def _alive() -> list[Any]:
    return [s for s in (ref() for ref, _ in _open) if s is not None]


def open_sessions() -> list[Any]:
    """The sessions of this process not yet closed, oldest first (a notebook's or a test harness's look)."""
    return _alive()


def opened(session: Any) -> None:
    peers = [weakref.ref(s) for s in _alive() if s.state.begun == 0]
    _open.append((weakref.ref(session), peers))


def closed(session: Any) -> None:
    """`session` closes. Where it started the process group and another session of this process is still open (a
    GAN's two sessions, the first made closed first), the group and the progress watch go on with that one, which
    leaves the group when it closes (the group left here failed that one's last save: "not registered")."""
    heir = next(iter(_companions(session)), None) if getattr(session, "owns_group", False) else None
    _open[:] = [(ref, peers) for ref, peers in _open if ref() is not None and ref() is not session]
    if heir is not None:   # (a companion: made beside it, not a session an earlier error left open)
        heir.owns_group, session.owns_group = True, False
        heir.watch, session.watch = heir.watch or session.watch, None


def earlier_companion(session: Any) -> Any:
    """The oldest session of this process still open that was made before `session` and had drawn no batch then (a
    GAN's first session, beside its second), or None."""
    alive = _alive()
    mine = next((peers for ref, peers in _open if ref() is session), [])
    return next((p() for p in mine if any(p() is s for s in alive)), None)


def _companions(session: Any) -> list[Any]:
    mine = next((peers for ref, peers in _open if ref() is session), [])
    out = []
    for ref, peers in _open:
        other = ref()
        if other is None or other is session:
            continue
        if any(p() is other for p in mine) or any(p() is session for p in peers):
            out.append(other)
    return out


def pieces_in_step(session: Any) -> bool:
    """Whether `session`'s loader runs the job's count of micro-batches a step on every rank (each rank's
    micro_batch and grad_accum) because another session is trained beside it in the same loop body: a
    loop body runs once per piece, and where ranks run different counts the two sessions' collectives (each
    DDP's gradient all-reduce, its buffer broadcasts, its bucket rebuild after the first step, the ranks'
    agreement at the first backward) would pair up across the models: gloo's 'Received data size doesn't match'
    and SIGABRT, or a hang. The companion's loader, made earlier with a count of its own on each rank, runs its
    job's count too, from its first batch. A rank short of pieces runs stand-ins (two samples, no items)."""
    others = [o for o in _companions(session) if getattr(o, "layout", None) is None]
    if not others or session.layout is not None or session.world_size == 1 or \
            all(mb is None and ga == 1 for mb, ga in session.assignment.pieces):
        return False
    for other in others:
        train = getattr(other, "train", None)
        if train is not None and train.loader.same_piece_count is None and other.state.begun == 0:
            train.loader.same_piece_count, other.state.equal_pieces = other.assignment.pieces, True
    return True


def other_parameters(session: Any) -> set[int]:
    """The ids of the parameters of the models that `session`'s companions prepared (sessions made beside it, not
    one an earlier error left open, a notebook cell's, whose model may be this one)."""
    return {id(p) for other in _companions(session) if getattr(other, "prepared", None) is not None
            for p in other.prepared.parameters}


def leading_loader(session: Any, global_batch_size: int, checkpoint_dir: Any = None) -> Any:
    """The loader of the first companion of `session` with a map-style loader of `global_batch_size` samples on as
    many ranks, or None. Refuses a companion that checkpoints to `checkpoint_dir` too (their saves would collide,
    and a resume would load the other model)."""
    leader = None
    for other in _companions(session):
        theirs = other.checkpoints.checkpointer.directory if other.checkpoints is not None else None
        if checkpoint_dir is not None and theirs is not None and \
                os.path.realpath(theirs) == os.path.realpath(checkpoint_dir):
            raise HetrainError(
                f"another hetrain.Session of this process, made beside this one, checkpoints to {checkpoint_dir}: two "
                "models trained side by side, each with its session (a GAN's), need a directory each: hetrain.Session("
                "checkpoint_dir=os.path.join(os.environ['HETRAIN_CHECKPOINT_DIR'], 'generator')); a session an error "
                "left open before its first batch (a notebook cell run again) holds it until its close()")
        train = getattr(other, "train", None)
        if leader is None and train is not None and not train.loader.stream and \
                train.loader.global_batch_size == global_batch_size and other.world_size == session.world_size:
            leader = train.loader
    return leader


class _LeadersSplit:
    """What a following loader schedules at its step k (for its step k + lag, the lag both loaders share): the
    split the leader's loader has scheduled for that step once it has drawn step k itself, else the split its
    balancer has decided, which the leader schedules for that step when it draws it. Each loader keeps its own
    schedule, so what its workers prefetched is always cut as it was read, whatever the two loops' order or
    pace (a critic stepped five times a generator step)."""

    def __init__(self, leader: Any, loader: Any) -> None:
        self.leader, self.loader = leader, loader
        self.config = getattr(leader.split, "config", None)   # the leader's balance settings (min_share)
        self._checked = True   # follow() opens the check once it has read the first split

    @property
    def shares(self) -> list[int]:
        step = self.loader.run_step
        if not self._checked and self.loader.step.begun == 0:   # the first draw: both at one step, or apart
            self._checked = True
            apart = self.leader.run_step - step
            if abs(apart) > 1 and self.loader.rank == 0:
                log.warning("this session is %d steps %s the one whose split it takes (they resumed from "
                            "checkpoints of different steps, after a SIGTERM stop or a crash during a background "
                            "save, or one trained alone first): a batch cut by one no longer has the other's size "
                            "after each re-split; resume both from checkpoints of one step, or give the first "
                            "session balance=False", abs(apart), "behind" if apart > 0 else "ahead of")
        if self.leader.run_step > step:   # the leader drew this step: its schedule holds step + lag
            return self.leader.schedule.at(step + self.loader.schedule.lag)
        return list(self.leader.split.shares)


def follow(loader: Any, leader: Any) -> None:
    """`loader` cuts each step as `leader` (another session's loader) does, both at the larger of their prefetch
    depths. Before the first batch; None: no change."""
    if leader is None:
        return
    if loader.rank == 0:
        log.info("this session takes the split of the one made beside it in this process (two models trained on "
                 "one batch): that session's balancer re-splits both (a session an earlier trial left open, not "
                 "closed after an error before its first batch, is taken for one: close each session)")
    lag = max(leader.schedule.lag, loader.schedule.lag)
    leader.schedule.lag = loader.schedule.lag = leader.split.lag = lag
    loader.split = _LeadersSplit(leader, loader)
    loader.schedule.changes = [(0, list(loader.split.shares))]   # from its first step (a resume loads its own)
    loader.split._checked = False
