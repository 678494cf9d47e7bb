"""Per-step compute timing and speed emulation, measured where collectives cannot distort it.

The compute of a step runs from the first forward to the moment the last gradient bucket is
ready, which DDP signals by calling the comm hook on its last bucket. Waiting for other ranks
happens after that point, so it is not counted. The optimizer step is timed separately. Under DDP
the clock starts at the wrapped module's forward, after DDP's own pre-forward collectives (the
bucket rebuild's broadcast in the second step): it waits for the other ranks, and is not compute
(nor is the copy of rank 0's buffers after the last backward, hetrain.runtime.buffers).

Speed emulation (CPU ranks only): a rank at speed ``s`` pads each measured compute interval to
``1/s`` of its length, before its last bucket is sent (under FSDP2, each stretch between two of its
collectives, hetrain.runtime.fsdp_waits), so the other ranks wait for it as they would wait for a
slower device. Whatever it produces is labelled as emulated.
"""

from __future__ import annotations

import inspect
import os
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.runtime.speeds import parse_speeds
from hetrain.vocabulary import Env

EMULATE_ENV = Env.EMULATE_SPEEDS


def emulated_speed(rank: int, world_size: int) -> float | None:
    """This rank's emulated speed from the launcher's environment, or None when not emulating. An
    elastic job (`--nnodes MIN:MAX`) gives one speed per rank it may have: a job that came back on
    fewer ranks runs rank r at speed r still."""
    text = os.environ.get(EMULATE_ENV)
    if not text:
        return None
    speeds = parse_speeds(text, EMULATE_ENV)   # exported by the user: the launcher checks its flag's value itself
    if len(speeds) < world_size:
        raise HetrainError(
            f"{len(speeds)} emulated speeds ({text}) for {world_size} ranks; give one speed per rank"
        )
    return speeds[rank]


class SleepClock:
    """Sleeps that do not drift: a sleep that wakes late shortens the next one, and each sleep asks
    for its usual lateness less, so an emulated device keeps its speed over many short waits
    (a plain sleep wakes about 0.1 ms late, which would slow an emulated device a little more
    than its speed says)."""

    def __init__(self) -> None:
        self.ahead = 0.0   # seconds the waits so far overshot
        self.late = 0.0    # how late a sleep wakes, on average

    def wait(self, seconds: float) -> float:
        """Wait about `seconds`; returns the seconds actually taken. A wait pays back at most a quarter of its
        length of what earlier ones overshot: one wake-up 20 ms late left twenty 1 ms waits unpadded, and the
        balancer, which reads medians, took the emulated slow rank for a fast one."""
        credit = min(self.ahead, 0.25 * seconds)
        due = seconds - credit
        self.ahead -= credit
        asked = due - self.late
        started = time.perf_counter()
        if asked > 0:
            time.sleep(asked)
        took = time.perf_counter() - started
        if asked > 0:   # a one-off late wake-up (a loaded host) is not the sleeps' usual lateness: counted to 1 ms
            self.late += 0.1 * (min(took - asked, 0.001) - self.late)
        self.ahead += took - due
        return took


EMULATION_CLOCK = SleepClock()   # one per process: every emulated wait of a rank shares its carry


def pad_to_speed(elapsed: float, speed: float | None) -> float:
    """Wait so that ``elapsed`` seconds of work take ``elapsed / speed``; returns the seconds taken,
    the wait included."""
    if speed is None or speed >= 1.0 or elapsed <= 0:
        return elapsed
    return elapsed + EMULATION_CLOCK.wait(elapsed * (1.0 / speed - 1.0))


def idle_fraction(wall_seconds, compute_seconds, last: int | None = None) -> float:
    """Fraction of the wall time of the last `last` steps (all when None) spent not computing."""
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 1):
        raise HetrainError(f"idle_fraction(last={last!r}): the number of recent steps to measure, 1 or more (None: "
                           "every step)")
    wall = list(wall_seconds)[-last:] if last else list(wall_seconds)
    comp = list(compute_seconds)[-last:] if last else list(compute_seconds)
    return max(0.0, 1.0 - sum(comp) / sum(wall)) if wall and sum(wall) > 0 else 0.0


class _WrappedHook:
    """The wrapped module's forward pre-hook. The module is the script's model, which a script may pickle
    or deep-copy (`torch.save(model.module)`): the hook then travels as one that does nothing."""

    def __init__(self, timer: "StepTimer") -> None:
        self.timer = timer

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.timer.wrapped_forward(module, args)

    def __reduce__(self) -> tuple:
        return (_NoHook, ())


class _NoHook:
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        return None


@dataclass
class StepTimer:
    """Compute seconds of the current step on this rank (emulation included)."""

    speed: float | None = None
    _start: float | None = None
    compute_s: float = 0.0          # forward+backward of the step, set when the last bucket is ready
    optimizer_s: float = 0.0
    last_optimizer_s: float = 0.0   # the optimizer time of the step that ended last
    on_grads_ready: Callable[[], None] | None = None   # told when this rank starts waiting on the others
    started_at: float | None = None  # the step's first forward (perf_counter), None until it runs
    _armed: bool = False            # a forward through DDP began and has not reached the wrapped module
    comm_waits: Any = None          # FSDP2: a CommWaits, the seconds in its collectives (not compute)
    _micro_s: float = 0.0           # compute of the step's micro-batches before the running one
    _paused: float | None = None    # when the last micro-batch (not the step's last) ended its backward
    between_s: float = 0.0          # the script's and the data's time between the step's micro-batches and
    #                                 before its step(), less the session's collectives in the script's time
    last_between_s: float = 0.0     # that time of the step that ended last
    _waits_in_compute: float = 0.0  # the session's collective calls made inside a compute stretch (global_mean
    #                                 between a forward and its backward): waits, taken out of the stretch
    _local_step_s: float | None = None   # ZeRO-1: its local optimizer's step seconds (None: not ZeRO-1)
    _local_began: float = 0.0
    _local_depth: int = 0

    def forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        """On the model the script calls (not DDP-wrapped): the step's first forward begins compute here."""
        self.compute_pre_hook(module, args)

    def outer_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        """Prepended to FSDP2's own pre-forward (its all-gather, which waits for the other ranks): the step's
        first training forward ends the script's own time here; compute begins after the gather."""
        if torch.is_grad_enabled():
            self.step_begins()
            self._unpause()

    def attach_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> Any:
        """Time a DDP model: the step's first forward begins at the wrapper (the script's own time ends),
        compute at the wrapped module's forward, after DDP's pre-forward collectives. Returns the handle of
        the hook on the script's own model (removed when the session closes: a model prepared again keeps none)."""
        ddp.register_forward_pre_hook(self._ddp_pre_hook)
        # the wrapped module is the script's own model: its hook pickles as one that does nothing
        return ddp.module.register_forward_pre_hook(_WrappedHook(self), prepend=True)

    def _ddp_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():   # an evaluation (no_grad, generate()) between steps: not the step's
            return
        if self.started_at is None:
            self.started_at = time.perf_counter()
        self._unpause()   # DDP's pre-forward collectives that follow are waits, as at the step's first piece
        self._armed = True   # this forward came through DDP: the wrapped module's next forward is compute

    def wrapped_forward(self, module: torch.nn.Module, args: Any) -> None:
        """The wrapped module's forward: compute, where DDP called it (an evaluation through model.module
        between steps is neither compute nor the step's)."""
        if self._armed:
            self._armed = False
            self.compute_pre_hook(module, args)

    def step_begins(self) -> None:
        """The step's work begins here (a pipeline's forward_backward, which no module hook sees): the
        script's own time since the last step ends."""
        if self.started_at is None:
            self.started_at = time.perf_counter()

    def compute_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._start is None and torch.is_grad_enabled():   # a training forward, not an evaluation
            self._start, self._waits_in_compute = time.perf_counter(), 0.0
            if self.comm_waits is not None:
                self.comm_waits.mark()
            if self.started_at is None:
                self.started_at = self._start
            self._unpause()   # a model no wrapper's hook saw begin

    def _unpause(self) -> None:
        """A training forward begins after a micro-batch: the time since it ended was the script's own (and
        the data's); what follows is the step's (FSDP2's all-gather, DDP's broadcasts: waits; then compute)."""
        if self._paused is not None:
            self.between_s += time.perf_counter() - self._paused
            self._paused = None

    def backward_returned(self, last: bool) -> None:
        """A backward returned: until the next training forward, or after the step's last backward until step(),
        the loop body's time is the script's (logging the loss before step()), not a wait on the other ranks."""
        if last:
            self._paused = time.perf_counter()
        else:
            self.micro_batch_done()

    def step_called(self) -> None:
        """step() begins: the script's own time since the step's last backward ends (what follows is the step's:
        ZeRO-1's and the balancer's collectives are waits)."""
        self._unpause()

    @contextmanager
    def collective(self) -> Iterator[None]:
        """A collective call of the session's between the steps' work (global_mean, clip_grad_norm_, barrier): its
        wait on the other ranks is theirs, neither the script's nor, between a forward and its backward, compute (a
        fast rank waiting there for a slow one's forward would look as slow to the balancer)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            if self._start is not None:
                self._waits_in_compute += time.perf_counter() - began
            elif self._paused is not None or self.started_at is None:   # in the script's time, which it leaves
                self.between_s -= time.perf_counter() - began
            # else: after the last gradient was ready, in the rest of backward (gather_rows' all-reduce on a tensor
            # no parameter of the model's made) or in step(): a wait already, not the script's to give back

    def micro_batch_done(self) -> None:
        """A micro-batch that is not the step's last ended its backward: compute pauses until the next
        training forward (what the loop body does between them is the script's, never padded as compute)."""
        if self._start is None:
            return
        self._micro_s += self._stretch()
        self._start, self._paused = None, time.perf_counter()

    def _stretch(self) -> float:
        """Compute since `_start`, less the session's collective calls in it, and under FSDP2 less its collectives'
        waits (its last stretch padded first)."""
        waits, self._waits_in_compute = self._waits_in_compute, 0.0
        if self.comm_waits is not None:
            self.comm_waits.finish()
            waits += self.comm_waits.since_mark()
        return max(0.0, time.perf_counter() - self._start - waits)

    def grads_ready(self) -> None:
        """Called when this rank's last gradient bucket is ready: the compute of the step is over."""
        if self._start is None:
            return
        # FSDP2: less its gathers and reduce-scatters, where ranks wait on each other (an emulated speed padded
        # each stretch between them); else the step's compute padded to an emulated speed once, here
        stretch = self._stretch()
        self.compute_s = self._micro_s + stretch if self.comm_waits is not None else \
            pad_to_speed(self._micro_s + stretch, self.speed)
        self._start, self._micro_s = None, 0.0
        told = self.on_grads_ready() if isinstance(self.on_grads_ready, weakref.WeakMethod) else self.on_grads_ready
        if told is not None:
            told()

    def __post_init__(self) -> None:
        # a session's bound method, held weakly: DDP's C++ reducer holds this timer through its comm hook, and a
        # cycle through it back to the session is one Python's collector cannot see (a closed session, its model
        # and process group were never freed)
        if inspect.ismethod(self.on_grads_ready):
            self.on_grads_ready = weakref.WeakMethod(self.on_grads_ready)

    def __getstate__(self) -> dict:
        """A copy of the prepared model (deepcopy, an AveragedModel of it) copies the hooks this timer's methods
        are: the copy tells no session and measures nothing a session reads."""
        return {**self.__dict__, "on_grads_ready": None, "comm_waits": None}

    def time_local_steps(self, optimizer: torch.optim.Optimizer) -> list[Any]:
        """ZeRO-1: the step's optimizer time is its rank-local optimizer's step alone (torch's step hooks on it),
        not the broadcast of every rank's part after it, where a fast rank waits for a slower one. The hooks'
        handles, to remove when the session closes."""
        def began(*_: Any) -> None:   # a subclass's step() calling super().step() runs the hooks again, inside
            self._local_depth += 1
            if self._local_depth == 1:
                self._local_began = time.perf_counter()

        def ended(*_: Any) -> None:
            self._local_depth -= 1
            if self._local_depth == 0:
                self._local_step_s = (self._local_step_s or 0.0) + time.perf_counter() - self._local_began

        self._local_step_s = 0.0
        return [optimizer.register_step_pre_hook(began), optimizer.register_step_post_hook(ended)]

    def time_optimizer(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        local = self._local_step_s is not None
        if local:
            self._local_step_s, self._local_depth = 0.0, 0
        out = fn()
        took = self._local_step_s if local else time.perf_counter() - t0
        self.optimizer_s = pad_to_speed(took, self.speed)
        return out

    def end_step(self) -> float:
        """The step's compute seconds (forward, backward, optimizer); resets for the next step."""
        total = self.compute_s + self.optimizer_s
        self.last_optimizer_s, self.last_between_s = self.optimizer_s, self.between_s
        self.compute_s = self.optimizer_s = self.between_s = self._micro_s = 0.0
        self._start = self.started_at = self._paused = None
        return total


@dataclass
class TimedHookState:
    """DDP comm-hook state: the inner hook (compression, hierarchy, plain all-reduce) and the timer."""

    timer: StepTimer
    inner_state: Any
    inner_hook: Callable[[Any, dist.GradBucket], torch.futures.Future]
    stats: Any = None   # a CommStats counting the bytes of a plain all-reduce (compressing hooks count their own)
    figures: Any = None  # a StepFigures to sum with a bucket (plain all-reduce only), set per step
    reduced: bool = False  # the last bucket went through this step (DDP's backward ran): read and reset per step
    bucket_bytes: dict[int, int] = field(default_factory=dict)   # this step's buckets so far, by index
    carrier: int | None = None   # the bucket the figures ride in (the last step's smallest)
    carrier_bytes: int | None = None

    def __getstate__(self) -> dict:
        """A copy of the prepared model (deepcopy, an AveragedModel of it) copies DDP's comm hook with this state;
        the copy's own reducer never calls it: it carries a timer of its own and no inner state or counters."""
        return dict(vars(TimedHookState(StepTimer(), None, self.inner_hook)))


# The step's figures ride in a bucket only if one was this small in the last step (DDP's first bucket, 1 MiB,
# on GPUs; a CPU job's DDP keeps all its gradients in one bucket): the bucket that takes them is copied, and a
# 25 MiB one copied twice cost 3.6 ms a step on a CPU rank, where an all-reduce of their own costs far less.
FIGURES_BUCKET_BYTES = 1 << 20


def figures_carrier(comm_state: Any) -> "TimedHookState | None":
    """The comm hook's state, when the step's figures can ride in one of its buckets (every rank decides alike:
    the buckets are the same on every rank), else None (they go in an all-reduce of their own)."""
    if not isinstance(comm_state, TimedHookState) or comm_state.inner_state is not None:
        return None
    small = comm_state.carrier_bytes is not None and comm_state.carrier_bytes <= FIGURES_BUCKET_BYTES
    return comm_state if small else None


def timed_hook(state, bucket):
    # No annotations: DDP checks them, and postponed annotations are strings.
    if bucket.is_last():
        state.timer.grads_ready()
        state.reduced = True
    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    if state.stats is not None:
        from hetrain.runtime.compression.stats import allreduce_bytes

        state.stats.add(allreduce_bytes(nbytes, dist.get_world_size()))
    state.bucket_bytes[bucket.index()] = nbytes
    carries = state.figures is not None and state.inner_state is None and \
        (bucket.index() == state.carrier or bucket.is_last())
    figures, state.figures = (state.figures, None) if carries else (None, state.figures)
    if bucket.is_last():   # the next step's figures ride in this step's smallest bucket, when small enough
        state.figures = None
        state.carrier = min(state.bucket_bytes, key=state.bucket_bytes.__getitem__)
        state.carrier_bytes, state.bucket_bytes = state.bucket_bytes[state.carrier], {}
    if figures is not None:
        return _allreduce_with_figures(bucket, figures)
    return state.inner_hook(state.inner_state, bucket)


def _allreduce_with_figures(bucket, figures):
    """The bucket's average, with the step's few figures summed in the same all-reduce (no collective of
    their own): the bucket and the figures travel as one tensor."""
    buf = bucket.buffer()
    n = figures.packet.numel()
    flat = torch.cat([buf, figures.packet.to(device=buf.device, dtype=buf.dtype)])
    world = dist.get_world_size()

    def split(fut):
        out = fut.value()[0]
        figures.packet = out[-n:].to(torch.float64)
        return out[:-n].div_(world)

    return dist.all_reduce(flat, async_op=True).get_future().then(split)
