"""Re-split the global batch while the job runs, from every rank's measured speed.

Every ``interval`` steps the ranks all-gather what each measured, without waiting: the figures
travel while the next step computes, and at that step's end every rank computes the same new
split with the planner's exact split function (identical inputs, pure functions: every rank
agrees, DESIGN.md invariant 4). What a rank contributes:

- its steps since the split last changed (its *window*, up to ``history * interval`` steps): the
  median compute time at its current share, and how much that time scatters from step to step
  (pooled with its earlier windows);
- its median step time and share of each interval, kept for the last ``history`` intervals.

Each rank's cost is modelled as ``fixed + n * per_sample`` (a step has a fixed part: the
optimizer, kernel launches, Python). The line goes through the window's median, the freshest and
steadiest figure, so the model decides how far the split moves, not where it settles: where the
medians are equal. Its slope is fitted on the intervals, which ran at different shares, when they
determine it well (the last such slope is kept once the split has settled); otherwise the line
goes through the origin too. That proportional line is steeper than the truth when a step has a
fixed part, so the split moves most of the way and never past the balance point: it settles in a
few re-splits without swinging.

Guards keep noise and outside load from moving samples:
- medians ignore a step slowed by outside load;
- a rank with two or more recent intervals (of the last ``LOAD_MEMORY * history``) at about its
  current share that took 0.8 of the modelled time or less is modelled at the second fastest one's
  speed: outside load only adds time; unless its last ``LASTING`` intervals at about its share were
  all slow, a slowdown that lasts (a device throttled, another job on it), which is the rank's speed:
  its intervals from before the slowdown, at any share, and the slope fitted on them are then dropped;
- the split changes only when the modelled step time falls by more than ``hysteresis`` *and* the
  gap between the slowest and the fastest rank exceeds three standard errors from the windows'
  own scatter, and two consecutive intervals ask for the same direction (the re-split right after
  one may continue its direction at two standard errors);
- each re-split moves a rank by a bounded amount (`bounded_move`): 10% of an even share first,
  doubling while consecutive re-splits keep the direction (until it first turns), halving at a
  turn; a re-split that does not directly follow another starts again at 10%. The job's first
  re-split may open with 30% when the gap is wide (the slowest rank's modelled step 1.3x the
  fastest's or more) and beyond six standard errors: a device difference, reached in two re-splits
  instead of three or four. Outside load later in a run never opens wide.
A rank at 0 samples is modelled at what its steps there took (until then, its line's fixed part:
hetrain.runtime.rank_measurement). With ``min_share`` 0, a rank moved to 0 samples (it measures no cost per
sample there) is given one sample for an
interval now and then, at ever longer waits while it stays too slow for it (`IdleProbes`).
A split decided at step t reaches the loop ``lag`` steps later (the loader's prefetch depth); those
steps, and the first one at the new sizes (it allocates), are not measured.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetrain.planning.batch_split import RankCost, rebalance, step_time
from hetrain.planning.plan import BalancePlan
from hetrain.runtime.cost_line import anchored_cost, fit_slope
from hetrain.runtime.idle_probes import IdleProbes
from hetrain.runtime.rank_measurement import MIN_SCATTER, RankMeasurement, median_or_nan, spread

log = logging.getLogger("hetrain.balance")

SIGNIFICANCE = 3.0      # standard errors the measured gap between ranks must exceed
CONTINUE_SIGNIFICANCE = 2.0   # ... to continue the last re-split's move, right after it
LOAD_MEMORY = 3         # intervals of `history` each rank's best recent speed is looked for in
NEAR = 0.15             # intervals within this fraction of the current share show the rank's best speed
FIRST_MOVE = 0.1        # the first re-split moves a rank by at most this fraction of an even share
OPENING_MOVE = 0.3      # ... the job's first re-split, when the gap is wide and far beyond the noise
WIDE_GAP = 1.3          # slowest over fastest modelled step time that counts as wide
LOADED = 0.8            # a window this much slower than the best recent interval (or more) was loaded
LASTING = 6             # intervals in a row at about the share, none of them fast: a slowdown that lasts


@dataclass
class SplitChange:
    step: int
    old: list[int]
    new: list[int]
    predicted_old_s: float
    predicted_new_s: float
    reason: str = "balance"   # one of SPLIT_REASONS (hetrain.metrics.events)


def _agree(move: Sequence[int], other: Sequence[int]) -> bool:
    """Two moves of the split go the same way (their changes of share point alike)."""
    return len(move) == len(other) and sum(d * e for d, e in zip(move, other)) > 0


def bounded_move(old: Sequence[int], new: Sequence[int], bound: float | None,
                 last_move: Sequence[int] | None, reversed_before: bool = False,
                 first: float = FIRST_MOVE) -> tuple[list[int], float]:
    """(the split ``new`` approached from ``old`` moving no rank by more than the bound, the bound used).

    The bound is ``FIRST_MOVE`` of an even share for the first re-split; until the direction first
    turns it doubles with each re-split that continues the last one's direction (a real speed
    difference asks for the same direction again and again and is reached in a few re-splits).
    A re-split that reverses the last one halves it, and after a reversal it no longer grows:
    outside load that comes and goes asks for reversals, and its swings shrink."""
    delta = [b - a for a, b in zip(old, new)]
    if bound is None:
        bound = first * sum(old) / len(old)
    elif last_move is not None and len(last_move) == len(delta):
        if not _agree(delta, last_move):
            bound *= 0.5
        elif not reversed_before:
            bound *= 2.0
    bound = max(bound, 1.0)
    scale = min(1.0, bound / max(abs(d) for d in delta))
    if scale >= 1.0:
        return list(new), bound
    target = [a + scale * d for a, d in zip(old, delta)]   # between old and new: within every bound
    out = [math.floor(x) for x in target]
    for i in sorted(range(len(out)), key=lambda i: out[i] - target[i])[: sum(old) - sum(out)]:
        out[i] += 1
    return out, bound


@dataclass
class Balancer:
    """Collects (samples, seconds) per step and re-splits every ``config.interval`` steps."""

    config: BalancePlan
    shares: list[int]
    warmup_steps: int = 1
    rank: int | None = None         # this rank: its window takes only steps at its full share
    devices: list[str] | None = None   # each rank's device kind: measurements belong to them
    share_caps: list[int | None] | None = None   # each rank's most samples (piece_caps: one piece over the count)
    _interval: list[tuple[int, float]] = field(default_factory=list)  # this rank's steps of the interval
    _window: list[tuple[int, float]] = field(default_factory=list)    # ... since the split last changed
    _scatter: list[tuple[float, int]] = field(default_factory=list)   # spread() of past windows
    _floors: list[float] = field(default_factory=list)   # its last steps' optimizer seconds, at any share
    _idle: list[float] = field(default_factory=list)     # this rank's steps at 0 samples since the split changed
    _skip: int | None = None                  # steps still to ignore (warm-up, first step at new sizes)
    lag: int = 0                    # steps between a decided split and the first step that uses it
    history: list[list[tuple[float, float]]] = field(default_factory=list)  # per rank, per interval
    recent: list[list[tuple[float, float]]] = field(default_factory=list)   # ... the last LOAD_MEMORY * history
    slopes: list[float | None] = field(default_factory=list)   # per rank, the last fitted per-sample cost
    costs: list[RankCost] | None = None        # the last model of every rank
    idle: list[float | None] = field(default_factory=list)   # per rank, what its last steps at 0 samples took
    changes: list[SplitChange] = field(default_factory=list)
    _move_bound: float | None = None           # samples a rank may move at the next re-split (None: first)
    _last_move: list[int] | None = None        # each rank's change of share at the last re-split
    _asked: list[int] | None = None            # the move the last re-split found and left to confirm
    _streak: bool = False                      # the last re-split with figures moved the split
    _reversed: bool = False                    # some re-split turned the direction of the one before
    _in_flight: Any = field(default=None, repr=False)   # the work of an exchange still on its way
    _arrived: list[RankMeasurement] | None = None        # its figures, until `settle` re-splits on them
    _exchanged: Any = field(default=None, repr=False)   # (local, gathered) of the last exchange, until the next
    probes: IdleProbes | None = None           # when a rank moved to 0 samples is measured again

    def __post_init__(self) -> None:
        if self._skip is None:
            self._skip = self.warmup_steps
        self.probes = self.probes or IdleProbes([n == 0 for n in self.shares])
        if self.share_caps is not None and self.config.enabled and self.rank == 0:
            log.info("every rank runs the job's count of micro-batches a step (FSDP2, SyncBatchNorm): re-splits add "
                     "at most one to it, a rank taking at most %s samples (re-plan with larger micro-batches to move "
                     "more)",
                     [c if c is not None else sum(self.shares) for c in self.share_caps])

    def _max_shares(self, min_share: int) -> int | list[int] | None:
        """The plan's max_share, and where every rank runs the job's count of micro-batches, each rank's cap
        (`share_caps`: one piece over the starting split's count; never below the current share or min_share)."""
        if self.share_caps is None:
            return self.config.max_share
        total = sum(self.shares)
        plan_cap = self.config.max_share if self.config.max_share is not None else total
        return [min(plan_cap, max(cap if cap is not None else total, now, min_share))
                for cap, now in zip(self.share_caps, self.shares)]

    @property
    def window_cap(self) -> int:
        return self.config.history * self.config.interval

    def record(self, samples: int, seconds: float, optimizer_seconds: float = math.nan) -> None:
        """One step of this rank: how many samples it computed, in how many seconds (compute and data wait), of
        them its optimizer step's (what its step takes at any share, at 0 samples too)."""
        if self._skip > 0:
            self._skip -= 1
            return  # the first steps pay for allocation and warm-up, not for samples
        if not math.isfinite(seconds):
            return
        self._floors = [*self._floors, optimizer_seconds][-self.window_cap:]   # the same at any share
        if samples <= 0:   # at its share of 0 (not a partial last batch's 0), its step's fixed part alone
            if seconds > 0 and (self.rank is None or self.shares[self.rank] == 0):
                self._idle = [*self._idle, seconds][-self.window_cap:]
            return
        self._interval.append((samples, seconds))
        del self._interval[: -self.config.interval]   # an interval's steps (balancing off: none is ever taken)
        full = self.shares[self.rank] if self.rank is not None else (self._window[0][0] if self._window else samples)
        if samples != full:
            return  # a partial last batch: not the share the window measures
        self._window.append((samples, seconds))
        del self._window[: -self.window_cap]

    def due(self, step: int) -> bool:
        return self.config.enabled and step > 0 and step % self.config.interval == 0

    def local_measurement(self) -> RankMeasurement:
        nan = math.nan
        if self._interval:
            n = sum(s for s, _ in self._interval) / len(self._interval)
            t = statistics.median(t for _, t in self._interval)
        else:
            n = t = nan
        if self._window:
            times = [t for _, t in self._window]
            med = statistics.median(times)
            # The scatter is pooled with past windows' (relative to each window's mean): a few steps
            # can agree by chance. Timings on a shared machine scatter by 1% at least.
            spreads = [*self._scatter, spread(times)]
            ss, dof = sum(x for x, _ in spreads), sum(d for _, d in spreads)
            sd = max(math.sqrt(ss / dof), MIN_SCATTER) * med if dof else math.nan
            return RankMeasurement(n, t, float(self._window[0][0]), med, sd, float(len(times)),
                                   median_or_nan(self._floors), median_or_nan(self._idle))
        return RankMeasurement(n, t, nan, nan, nan, 0.0, median_or_nan(self._floors), median_or_nan(self._idle))

    def take_measurement(self) -> RankMeasurement:
        """This rank's measurement, ending the interval."""
        m = self.local_measurement()
        self._interval = []
        return m

    def begin_exchange(self, device: torch.device, group=None, *, step: int | None = None) -> None:
        """Start the all-gather of every rank's measurement of this interval and of its window, and
        return at once: it completes while the next step computes, and `settle` re-splits on it
        then. No step stops for it, so the exchange adds no wait for the slowest rank of its own.
        With `step`, only when an interval ends at that step."""
        if step is not None and not self.due(step):
            return
        m = self.take_measurement()
        local = torch.tensor(dataclasses.astuple(m), dtype=torch.float64, device=device)
        out = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
        self._in_flight = dist.all_gather(out, local, group=group, async_op=True)
        # held until the next exchange: gloo's worker frees the finished gather after `arrived` returns,
        # and tensors still held here are then freed without the interpreter lock (see settle_at_exit)
        self._exchanged = (local, out)

    def arrived(self) -> list[RankMeasurement] | None:
        """The figures of the exchange begun last (waiting for them if they are still on their way),
        until `settle` uses them; None when no exchange is pending."""
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None
            self._arrived = [RankMeasurement(*(float(v) for v in t.tolist())) for t in self._exchanged[1]]
        return self._arrived

    def settle(self, step: int) -> bool | None:
        """Re-split on the exchange begun at the end of the last interval (one step ago): True when
        the split changed, False when it was kept, None when no exchange was pending."""
        observed = self.arrived()
        if observed is None:
            return None
        self._arrived = None
        return self.rebalance(step, observed)

    def rebalance(self, step: int, observed: Sequence[RankMeasurement]) -> bool:
        """Model each rank's cost, apply the best split if it is faster by more than the hysteresis
        and the measured gap between ranks is more than noise. Every rank runs this on the same
        figures and reaches the same split."""
        ranks = len(observed)
        if len(self.history) != ranks:
            self.history = [[] for _ in range(ranks)]
            self.slopes = [None] * ranks
        if len(self.idle) != ranks:
            self.idle = [None] * ranks
        if len(self.recent) != ranks:
            self.recent = [list(h) for h in self.history]
        for r, m in enumerate(observed):
            if m.has_interval():
                self.history[r].append((m.samples, m.seconds))
                del self.history[r][: -self.config.history]
                self.recent[r].append((m.samples, m.seconds))
                del self.recent[r][: -LOAD_MEMORY * self.config.history]
            slope = fit_slope(self.history[r])
            if slope is not None:
                self.slopes[r] = slope
            if m.has_idle():
                self.idle[r] = m.idle_seconds
        fitted: list[RankCost | None] = []
        for r, m in enumerate(observed):
            if m.has_window():
                fitted.append(anchored_cost(m.window_samples, m.window_seconds, self.slopes[r], m.floor()))
            elif m.has_interval():
                fitted.append(anchored_cost(m.samples, m.seconds, self.slopes[r], m.floor()))
            else:
                fitted.append(None)
        loads = [self._load_factor(r, c) for r, c in enumerate(fitted)]
        fitted = [RankCost(c.per_sample * f, c.fixed * f) if c is not None else None for c, f in zip(fitted, loads)]
        known = [c for c in fitted if c is not None]
        if not known:
            return False
        # a rank without a measurement this interval (no samples: min_share 0) keeps its last model; one
        # never measured is assumed to cost what the average rank costs (a share the plan left at 0 is
        # tried, and given back once measured slow), and has no model of its own (`costs` None)
        fill = RankCost(per_sample=sum(c.per_sample for c in known) / len(known),
                        fixed=sum(c.fixed for c in known) / len(known))
        last = self.costs if self.costs is not None and len(self.costs) == ranks else [None] * ranks
        self.costs = [c if c is not None else last[r] for r, c in enumerate(fitted)]   # None: never measured
        # a rank at 0 samples costs what its steps there took, or until it has run some its line's fixed part
        costs = [dataclasses.replace(c or fill, idle=i) for c, i in zip(self.costs, self.idle)]
        min_share = min(self.config.min_share, sum(self.shares) // len(self.shares))
        probe = self.probes.next_split(self.shares, [m.has_window() for m in observed], costs, min_share,
                                       self._max_shares(min_share))
        if probe is not None:   # a rank at 0 samples measured again, or back to 0: no move of the balance's own
            self._asked, self._streak = None, False
            reason = "try" if self.probes.probing is not None else "back"
            return probe[0] != self.shares and self._resplit(step, probe[0], costs, probe[1], reason)
        # Windows shorter than an interval (just after a re-split) are too short to weigh a gap: a move
        # in flight keeps its streak while they grow, instead of starting over from a confirmation.
        young = any(m.has_window() and m.window_steps < self.config.interval for m in observed)
        if not self._gap_is_real(observed, loads, min(SIGNIFICANCE, CONTINUE_SIGNIFICANCE)):
            # within the noise at the loosest threshold: no move can pass, the split search is not run
            self._asked, self._streak = None, self._streak and young
            return False
        new, _, _ = rebalance(self.shares, costs, min_share=min_share, max_share=self._max_shares(min_share),
                              hysteresis=self.config.hysteresis)
        asked, self._asked = self._asked, None
        streak, self._streak = self._streak, False
        if new == self.shares:
            return False
        # a move that does not follow the last re-split directly starts again from the first bound
        new, bound = bounded_move(self.shares, new, self._move_bound if streak else None,
                                  self._last_move if streak else None, self._reversed,
                                  first=OPENING_MOVE if self._opening(observed, loads, costs) else FIRST_MOVE)
        move = [b - a for a, b in zip(self.shares, new)]
        # a re-split right after one that went the same way continues a confirmed move
        continues = streak and self._last_move is not None and _agree(move, self._last_move)
        if not self._gap_is_real(observed, loads, CONTINUE_SIGNIFICANCE if continues else SIGNIFICANCE):
            log.debug("step %d: kept split %s: the gap between ranks is within their noise (%s)", step,
                      self.shares, ", ".join(f"{1e3 * m.window_seconds:.1f}±{1e3 * m.standard_error():.1f} ms"
                                             for m in observed))
            self._streak = continues and young
            return False
        if not continues and (asked is None or not _agree(move, asked)):
            self._asked = move   # confirmed at the next re-split, or dropped: a passing load asks once
            log.debug("step %d: split %s -> %s waits for the next interval to confirm it", step, self.shares, new)
            return False
        # a reversal stops the bound growing for the rest of a run of re-splits; a new run starts afresh
        self._reversed = streak and (self._reversed or (self._last_move is not None and not _agree(move, self._last_move)))
        self._last_move = move
        self._move_bound = bound
        self._streak = True
        return self._resplit(step, new, costs)

    def _resplit(self, step: int, new: list[int], costs: Sequence[RankCost], why: str = "",
                 reason: str = "balance") -> bool:
        """Take the split `new`, decided at `step` (True), for `reason` (SPLIT_REASONS)."""
        t_old, t_new = step_time(self.shares, costs), step_time(new, costs)
        self.changes.append(SplitChange(step, list(self.shares), new, t_old, t_new, reason))
        log.info("step %d: split %s -> %s (predicted compute per step %.1f ms -> %.1f ms)%s",
                 step, self.shares, new, 1e3 * t_old, 1e3 * t_new, f": {why}" if why else "")
        self.shares = new
        self._scatter = [*self._scatter, spread([t for _, t in self._window])][-self.config.history:]
        self._window, self._idle = [], []
        # the loop reaches the new split `lag` steps later; its first step at the new sizes allocates
        self._skip = max(self._skip, 1 + self.lag)
        return True

    def with_reason(self, record: Any) -> Any:
        """A step's record (a StepRecord) with why the split changed at that step, where it did."""
        return dataclasses.replace(record, split_reason=self.changes[-1].reason) if record.split_changed else record

    def _opening(self, observed: Sequence[RankMeasurement], loads: Sequence[float], costs: Sequence[RankCost]) -> bool:
        """The job's first re-split, on a gap between ranks that is wide and far beyond their noise: a
        device difference, which the opening move covers in fewer re-splits."""
        if self._move_bound is not None:   # set by every re-split of the balance's own, and saved with it
            return False
        times = [c.time(n) for c, n in zip(costs, self.shares)]
        return (min(times) > 0 and max(times) >= WIDE_GAP * min(times)
                and self._gap_is_real(observed, loads, 2 * SIGNIFICANCE))

    def _load_factor(self, rank: int, cost: RankCost | None) -> float:
        """How much of the rank's modelled time is outside load (1: none): the second fastest of its
        recent intervals at about its share against the model. Outside load only adds time, so a
        rank's speed is what its best recent intervals show; a slowdown seen in the last ``LASTING``
        intervals near the share is the rank's speed, and what it measured before is dropped."""
        if cost is None or len(self.recent) <= rank:
            return 1.0
        share = self.shares[rank]
        # intervals near the current share only: the model is not trusted far from where it was measured
        near = [(i, t / cost.time(n)) for i, (n, t) in enumerate(self.recent[rank])
                if abs(n - share) <= NEAR * share and cost.time(n) > 0]
        ratios = [x for _, x in near]
        if len(ratios) < 2:
            return 1.0   # no two fast intervals to go by
        best = sorted(ratios)[1]   # the second best: one lucky interval is not the rank's speed
        if len(ratios) >= LASTING and min(ratios[-LASTING:]) > LOADED:
            if best <= LOADED:
                self._forget_before(rank, near[-LASTING][0])
            return 1.0   # the slowdown has lasted: the rank's speed
        return best if best <= LOADED else 1.0   # a smaller difference is noise, not load

    def _forget_before(self, rank: int, first: int) -> None:
        """A slowdown has lasted from the rank's interval ``recent[rank][first]`` on: its speed changed, and
        what it measured before (its fast intervals, at any share, and the slope fitted on them) would stand
        for a speed it no longer has. Kept, they made a lasting slowdown look like outside load again each time
        the split came back near a share it ran fast at, and the split swung back and forth."""
        kept = len(self.recent[rank]) - first
        del self.recent[rank][:first]
        del self.history[rank][: max(len(self.history[rank]) - kept, 0)]
        self.slopes[rank] = fit_slope(self.history[rank])
        self.idle[rank] = None   # measured at 0 samples before the change, as slow or as fast as it was then

    @staticmethod
    def _gap_is_real(observed: Sequence[RankMeasurement], loads: Sequence[float] | None = None,
                     significance: float = SIGNIFICANCE) -> bool:
        """True if the slowest rank's window median exceeds the fastest's by more than noise
        (each median taken without the outside load its `loads` factor removes)."""
        loads = loads or [1.0] * len(observed)
        timed = [(m.window_seconds * f, m.standard_error() * f) for m, f in zip(observed, loads) if m.has_window()]
        if len(timed) < 2:
            return True   # a rank without figures, or just one: nothing to weigh the gap against
        slow, fast = max(timed), min(timed)
        return slow[0] - fast[0] > significance * math.hypot(slow[1], fast[1])

    def state_dict(self) -> dict:
        return {"shares": list(self.shares), "devices": self.devices,
                "history": [[list(p) for p in h] for h in self.history],
                "recent": [[list(p) for p in h] for h in self.recent],
                "slopes": list(self.slopes),
                "costs": None if self.costs is None else [c and [c.per_sample, c.fixed] for c in self.costs],
                "idle": list(self.idle),
                "skip": self._skip,
                "move_bound": self._move_bound, "last_move": self._last_move, "asked": self._asked,
                "streak": self._streak, "reversed": self._reversed, "probes": self.probes.state_dict(),
                # an exchange begun at the saved step: a resumed run re-splits on it where this run does
                "arrived": [dataclasses.astuple(m) for m in self.arrived() or []]}

    def local_state_dict(self) -> dict:
        """This rank's own step times, saved with its own state: the shared state (`state_dict`) is rank 0's and
        holds none."""
        return {"interval": [list(p) for p in self._interval], "window": [list(p) for p in self._window],
                "scatter": [list(x) for x in self._scatter], "floors": list(self._floors), "idle": list(self._idle)}

    def load_local_state_dict(self, state: dict | None) -> None:
        """This rank's own step times, after `load_state_dict`; None (a checkpoint without them): none, not rank
        0's, which a rank at 0 samples would report as its own until it measures again."""
        state = state or {}
        self._interval = [(int(n), float(t)) for n, t in state.get("interval", [])]
        self._window = [(int(n), float(t)) for n, t in state.get("window", [])]
        self._scatter = [(float(ss), int(dof)) for ss, dof in state.get("scatter", [])]
        self._floors = [float(t) for t in state.get("floors", [])]
        self._idle = [float(t) for t in state.get("idle", [])]

    def load_state_dict(self, state: dict) -> bool:
        """Continue from a saved balancer of as many ranks; False (this run's split and no history kept)
        where the ranks now have other device kinds, whose measurements would say the wrong ranks are slow."""
        if state.get("devices") is not None and self.devices is not None and state["devices"] != self.devices:
            return False
        self.shares = [int(s) for s in state["shares"]]
        self.history = [[(float(n), float(t)) for n, t in h] for h in state["history"]]
        self.recent = [[(float(n), float(t)) for n, t in h] for h in state.get("recent", state["history"])]
        self.slopes = [None if s is None else float(s) for s in state.get("slopes", [None] * len(self.history))]
        saved_costs = state.get("costs")   # a rank at 0 samples measures nothing: its model is only here
        self.costs = None if saved_costs is None else [c and RankCost(float(c[0]), float(c[1])) for c in saved_costs]
        self.idle = [None if t is None else float(t) for t in state.get("idle", [])]
        self._skip = int(state.get("skip", 0))
        self._move_bound = state.get("move_bound")
        self._last_move = state.get("last_move")
        self._asked = state.get("asked")
        self._streak = bool(state.get("streak", False))
        self._reversed = bool(state.get("reversed", False))
        self.probes.load_state_dict(state.get("probes", {}))
        self._in_flight = None
        self._arrived = [RankMeasurement(*(float(v) for v in m)) for m in state.get("arrived", [])] or None
        return True
