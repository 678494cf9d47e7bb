"""When the balancer measures again a rank it moved to no samples (``min_share`` 0).

A rank at 0 samples measures its step there but no cost per sample, so its line stays the one that sent it there: a
rank slowed for a while (a throttled device, another job on it) would stay idle after it recovered. Now and then
such a rank is given one sample for an interval; if it is still too slow to take even that, the split goes back to
the one before and the wait before the next try doubles. The wait counts in what a try costs: a try whose step is
modelled to take k times the current one waits k - 1 times as long (at least as long), so a try is modelled to cost
at most a quarter of the time since the last one, a rank that stays slow costs ever less, and one that recovers is
back within about as long as it was idle. A rank the plan left idle is not re-measured: the balancer tries it once
(its model is then unknown) and keeps it idle once measured slow, as the plan asked; one that try found fast enough
to keep its samples is re-measured like any other if it goes idle later. Pure decisions on the figures every rank
shares: every rank reaches the same split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hetrain.planning.batch_split import RankCost, split_min_max, step_time

PROBE_AFTER = 4         # intervals at 0 samples before a rank is first measured again (times what a try costs)


@dataclass
class IdleProbes:
    """Per rank, how long it has been idle and when it is measured again."""

    planned_idle: list[bool]          # ranks the plan gave no samples: never re-measured
    waited: list[int] = field(default_factory=list)   # intervals at 0 samples since the rank was last measured
    gaps: list[int] = field(default_factory=list)     # intervals to wait before measuring it again
    probing: int | None = None        # the rank given one sample for this interval
    before: list[int] | None = None   # the split that interval came from
    held: list[int] = field(default_factory=list)     # intervals in a row each rank has had samples

    def next_split(self, shares: Sequence[int], measured: Sequence[bool], costs: Sequence[RankCost],
                   min_share: int, max_share: int | list[int] | None) -> tuple[list[int], str] | None:
        """Count one interval. (the split to take, why) for a re-measurement that starts or finds the rank
        still slow, the current split while the one under way has no figure yet, None otherwise (a rank the
        measurement found fast enough keeps its sample and the balancer goes on from there)."""
        ranks = len(shares)
        if len(self.waited) != ranks:
            self.waited, self.gaps = [0] * ranks, [PROBE_AFTER] * ranks
        if self.probing is not None:
            rank, before = self.probing, self.before
            if not measured[rank]:
                return list(shares), ""   # its first step at the new size was not measured: wait an interval
            self.probing, self.before = None, None
            if before is not None and split_min_max(sum(shares), costs, min_share, max_share)[rank] == 0:
                self.waited[rank], self.gaps[rank] = 0, 2 * self.gaps[rank]
                return before, (f"rank {rank} is still too slow for one sample; measured again in about "
                                f"{self._wait(before, rank, costs, min_share):.0f} intervals")
            self.gaps[rank] = PROBE_AFTER
            return None
        if len(self.held) != ranks:
            self.held = [0] * ranks
        for r, n in enumerate(shares):
            self.held[r] = self.held[r] + 1 if n > 0 else 0
            if self.held[r] >= 3 and r < len(self.planned_idle):   # kept past its try (given, not measured at
                self.planned_idle[r] = False   # once, measured): fast enough, whatever the plan thought
            planned = r < len(self.planned_idle) and self.planned_idle[r]
            self.waited[r] = self.waited[r] + 1 if n == 0 and not planned else 0
        due = [r for r in range(ranks) if self.waited[r] and self.waited[r] >= self._wait(shares, r, costs, min_share)]
        if not due:
            return None
        rank = due[0]
        self.probing, self.before = rank, list(shares)
        return self._try(shares, rank, costs, min_share), (f"to measure rank {rank} again after {self.waited[rank]} "
                                                           "intervals at 0 samples")

    @staticmethod
    def _try(shares: Sequence[int], rank: int, costs: Sequence[RankCost], min_share: int) -> list[int]:
        """The split with one sample moved to `rank` from the rank modelled slowest that can give one."""
        donors = [k for k in range(len(shares)) if shares[k] > max(min_share, 1)]
        new = list(shares)
        if donors:
            new[max(donors, key=lambda k: costs[k].time(shares[k]))] -= 1
            new[rank] += 1
        return new

    def _wait(self, shares: Sequence[int], rank: int, costs: Sequence[RankCost], min_share: int) -> float:
        """Intervals at 0 samples before `rank` is tried: its gap, times the modelled cost of a try in intervals."""
        new, now = self._try(shares, rank, costs, min_share), step_time(shares, costs)
        if new == list(shares) or now <= 0:
            return float("inf")   # no rank can give a sample
        return self.gaps[rank] * max(1.0, step_time(new, costs) / now - 1.0)

    def state_dict(self) -> dict:
        return {"waited": list(self.waited), "gaps": list(self.gaps), "probing": self.probing, "before": self.before,
                "held": list(self.held), "planned_idle": list(self.planned_idle)}

    def load_state_dict(self, state: dict) -> None:
        self.waited = [int(n) for n in state.get("waited", [])]
        self.gaps = [int(n) for n in state.get("gaps", [])]
        self.probing = state.get("probing")
        self.before = state.get("before")
        self.held = [int(n) for n in state.get("held", [])]
        if "planned_idle" in state:
            self.planned_idle = [bool(p) for p in state["planned_idle"]]
