"""Where a loader stands as of the last step taken: what its checkpoints resume from.

A batch drawn and given no step is not part of the run: a peek at the data on rank 0 after the last
step (`next(iter(loader))` to log predictions), or a whole pass that only reads. Counted, such draws
moved the position a closing session saved, and a resumed run skipped a batch, or an epoch, silently.
A draw tells whether the one before it got a step (`StepState.finished` moved since); the position
saved is the one after the last draw that did.
"""

from __future__ import annotations

Position = tuple[int, int, int]   # (epoch, steps of the epoch handed out, steps since the run began)


class StepPosition:
    """The position after the loader's last stepped draw."""

    def __init__(self) -> None:
        self._stepped: Position | None = None   # after the last draw that got a step (set at the first draw)
        self._finished_at_draw: int | None = None   # steps finished when the last draw was made

    def _last_draw_stepped(self, finished: int) -> bool:
        return self._finished_at_draw is None or finished > self._finished_at_draw

    def drawing(self, position: Position, finished: int) -> None:
        """A batch is about to be drawn at `position` (before it), with `finished` steps finished so far."""
        if self._last_draw_stepped(finished):
            self._stepped = position
        self._finished_at_draw = finished

    def saved(self, position: Position, finished: int) -> Position:
        """What a checkpoint holds, the loader being at `position` now."""
        return position if self._last_draw_stepped(finished) else self._stepped
