"""Why the planner chose its strategy over a candidate predicted faster: the words of its notes."""

from __future__ import annotations

from hetrain.vocabulary import PIPELINE_STRATEGIES

MODEL_ERROR = 0.15
"""Median error of the cost model's relative speed of two GPU kinds on a source it never saw, with
several GPUs (12.7% in docs/cost-model.md, rounded up): a smaller predicted gain is no reason to
switch strategy."""
PIPELINE_NEEDS = ("a pipeline plan needs the script's steps written with session.forward_backward and the model "
                  "as nn.Sequential of its blocks (docs/pipeline.md), where a data-parallel plan runs any script")
"""What a script must do to run a pipeline plan: why auto keeps to data parallelism while it can."""
PIPELINES_WEIGHED = ("model state does not fit every device with plain data parallelism; ZeRO considered, and "
                     "pipelines weighed (auto chooses one only when the model fits on no single device, or when no "
                     "data-parallel plan fits)")
"""The note of an auto plan that needed ZeRO for a model some device holds whole."""
_WHEN = {
    "zero1": "ZeRO-1 is considered only when model state does not fit every device with plain data parallelism: "
             "it adds a parameter broadcast after every optimizer step, which nothing hides",
    "zero3": "ZeRO-3 (FSDP) is considered only when model state does not fit every device with plain data "
             "parallelism: it gathers every block's weights in forward and again in backward",
    **dict.fromkeys(PIPELINE_STRATEGIES,
                    "auto chooses a pipeline only when the model fits on no single device: " + PIPELINE_NEEDS),
    "ddp": "uniform DDP is the baseline",
}


def why_not(chosen, other) -> str:
    """Why a candidate predicted faster than the chosen one was not chosen."""
    gain = other.samples_per_s / chosen.samples_per_s - 1.0
    size = (f"its predicted gain, {gain:.1%}, is within the cost model's error (about {MODEL_ERROR:.0%})"
            if gain < MODEL_ERROR else f"its predicted gain is {gain:.1%}")
    reason = _WHEN.get(other.strategy, f"{other.strategy} is not among the strategies auto compares here")
    flag = "pipeline" if other.strategy == "hybrid" else other.strategy   # --strategy pipeline weighs both
    return (f"not {other.strategy}, predicted {other.samples_per_s:.1f} samples/s against {chosen.samples_per_s:.1f}: "
            f"{reason}; {size}; pass --strategy {flag} to use it")


def idle_devices_note(ranks) -> str | None:
    """A note naming ranks the split gives no samples whose optimizer step alone is longer than the other ranks'
    whole step: they slow the job down, and leaving them out of it is faster."""
    busy = [r.predicted_step_seconds for r in ranks if r.share > 0 and r.predicted_step_seconds is not None]
    idle = [r for r in ranks if r.share == 0 and r.predicted_step_seconds is not None]
    if not busy or not idle:
        return None
    slow = [r for r in idle if r.predicted_step_seconds > max(busy)]
    if not slow:
        return None
    names = ", ".join(sorted({r.device for r in slow}))
    worst = max(r.predicted_step_seconds for r in slow)
    many = len(slow) > 1
    return (f"rank{'s' if many else ''} {', '.join(str(r.rank) for r in slow)} ({names}) "
            f"{'get' if many else 'gets'} no samples and {'still run' if many else 'still runs'} every optimizer step, {worst * 1e3:.1f} ms, longer than the other ranks' whole step "
            f"({max(busy) * 1e3:.1f} ms): the job is faster without them; plan and launch it on the other devices")
