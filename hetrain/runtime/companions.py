"""Sessions open in one process. A script that trains two models on one batch, each with its own session (a
GAN's generator and discriminator, each with its optimizer), has two balancers that would each re-split on its
own timings: their splits part, and a batch one session cut weighs wrongly in the other (a rank computes the
generator's loss on the discriminator's 20 samples while the generator's session weighs it as 21 of 32). A
session whose loader is made while another open session of the process reads global batches of the same size
takes that session's split, step by step: the first session's balancer measures and re-splits both."""

from __future__ import annotations

import logging
import weakref
from typing import Any

log = logging.getLogger("hetrain")

_open: list[weakref.ref] = []   # sessions not yet closed, in the order they were made


def opened(session: Any) -> None:
    _open.append(weakref.ref(session))


def closed(session: Any) -> None:
    _open[:] = [ref for ref in _open if ref() is not None and ref() is not session]


def leading_loader(session: Any, global_batch_size: int) -> Any:
    """The loader of the first other open session with a map-style loader of `global_batch_size` samples on as
    many ranks, or None."""
    for ref in list(_open):
        other = ref()
        if other is None or other is session or getattr(other, "train", None) is None:
            continue
        loader = other.train.loader
        if not loader.stream and loader.global_batch_size == global_batch_size and other.world_size == session.world_size:
            return loader
    return None


def follow(loader: Any, leader: Any) -> None:
    """`loader` cuts each step as `leader` (another session's loader) does: its split source (that session's
    balancer) and schedule, at the larger of the two prefetch depths. Before the first batch; None: no change."""
    if leader is None:
        return
    if loader.rank == 0:
        log.info("this session takes the split of the one made before it in this process (two models trained on one "
                 "batch): that session's balancer re-splits both")
    leader.schedule.lag = leader.split.lag = max(leader.schedule.lag, loader.schedule.lag)
    loader.split, loader.schedule = leader.split, leader.schedule
    if loader.sampler is not None:
        loader.sampler.schedule = leader.schedule
