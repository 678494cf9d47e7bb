"""The ideal step of a pipeline schedule: each stage's compute in the order the schedule runs it,
with no transfer or overhead, the figure a partition is worth before hetrain or torch spend anything.

GPipe and 1F1B have a closed form (m - 1 micro-batches of the slowest stage plus one through every
stage); interleaved 1F1B's order comes from torch's own schedule (`get_schedule_ops`, the action
lists `ScheduleInterleaved1F1B` runs) and is replayed here.
"""

from __future__ import annotations


def fill_drain_seconds(stage_seconds: list[float], microbatches: int) -> float:
    """A GPipe/1F1B step with no transfer or overhead: m - 1 micro-batches on the slowest stage, plus one
    through every stage (`stage_seconds`: forward and backward of one micro-batch per stage)."""
    return (microbatches - 1) * max(stage_seconds) + sum(stage_seconds)


def interleaved_order(ranks: int, microbatches: int, chunks: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, torch's interleaved 1F1B actions in order: ("F" or "B", stage, micro-batch)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops("Interleaved1F1B", ranks, microbatches, chunks)
    return [[("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index, a.microbatch_index)
             for a in rank if a is not None] for rank in ops]


def replay_seconds(order: list[list[tuple[str, int, int]]], forward_seconds: list[float]) -> float:
    """The step's end when each rank runs its actions in order, as soon as their inputs exist: the
    forward of stage s after that of s - 1, the backward of s after that of s + 1 (and its own forward).
    `forward_seconds[s]`: stage s's forward of one micro-batch; backward takes twice as long."""
    last = len(forward_seconds) - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(order)
    at = [0] * len(order)
    while any(i < len(actions) for i, actions in zip(at, order)):
        moved = False
        for r, actions in enumerate(order):
            while at[r] < len(actions):
                kind, s, mb = actions[at[r]]
                needs = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else [])
                if any(n not in done for n in needs):
                    break
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = done[(kind, s, mb)] = start + forward_seconds[s] * (1.0 if kind == "F" else 2.0)
                at[r] += 1
                moved = True
        if not moved:
            raise ValueError("the schedule's actions wait on each other")
    return max(clock)


def ideal_step_seconds(schedule: str, stage_seconds: list[float], microbatches: int, chunks: int = 1) -> float:
    """The ideal step: `stage_seconds` is each pipeline stage's forward and backward of one micro-batch,
    in pipeline order (with chunks, stage s runs on rank s % (stages / chunks))."""
    if schedule != "interleaved-1f1b":
        return fill_drain_seconds(stage_seconds, microbatches)
    ranks = len(stage_seconds) // chunks
    return replay_seconds(interleaved_order(ranks, microbatches, chunks), [t / 3.0 for t in stage_seconds])
