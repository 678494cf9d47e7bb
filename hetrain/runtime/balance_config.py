"""What a session's balancer runs with: the plan's split and balance settings, the session's
overrides, and the checks that a global batch can hold them. Pure decisions, no process group."""

from __future__ import annotations

from dataclasses import dataclass

from hetrain.errors import HetrainError
from hetrain.planning.plan import BalancePlan, Plan
from hetrain.runtime.memory import job_piece_count


@dataclass(frozen=True)
class BalanceSetup:
    """The starting split by rank and the balance settings the session's `Balancer` takes."""

    shares: list[int]
    config: BalancePlan


def balance_overrides(balance: object, interval: object) -> tuple[bool | None, int | None]:
    """`Session(balance=, balance_interval=)`, checked (one line naming the setting): a string such as
    "no" would count as true and turn the balancer on."""
    if balance is not None and not isinstance(balance, bool):
        raise HetrainError(f"Session(balance={balance!r}): give True, False or None (the plan's setting)")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
        raise HetrainError(f"Session(balance_interval={interval!r}): give the steps between re-splits, "
                           "an integer of at least 1")
    return balance, interval


def balance_setup(plan: Plan | None, plan_shares: list[int], world_size: int, global_batch_size: int,
                  balance: bool | None = None, interval: int | None = None, *, pipeline: bool = False) -> BalanceSetup:
    """The plan's shares (`plan_shares`, by rank; an even split without a plan) and its balance
    settings, with `Session(balance=, balance_interval=)` applied. A pipeline's replica shares are
    the plan's, so its balancer stays off (`pipeline`; so does a session taking another's split). Raises
    one line when the loader's global batch differs from the plan's or cannot give every rank `min_share`
    samples."""
    if plan is not None and plan.global_batch_size != global_batch_size:
        raise HetrainError(
            f"the plan is for a global batch of {plan.global_batch_size}, the loader asks for "
            f"{global_batch_size}; use the same global_batch_size or re-plan"
        )
    shares = list(plan_shares) if plan is not None else Plan.even(world_size, global_batch_size).shares
    config = (plan.balance if plan is not None else BalancePlan()).model_copy()
    if balance is not None:
        config.enabled = balance
    if pipeline:
        config.enabled = False
    balance, interval = balance_overrides(balance, interval)
    if interval is not None:
        config.interval = interval
    if config.min_share * world_size > global_batch_size:
        raise HetrainError(
            f"balance.min_share {config.min_share} on {world_size} ranks needs a global batch of at least "
            f"{config.min_share * world_size}, not {global_batch_size}; lower min_share or raise the global batch"
        )
    if config.enabled and config.max_share is not None:
        if config.max_share * world_size < global_batch_size:
            raise HetrainError(
                f"balance.max_share {config.max_share} on {world_size} ranks holds at most "
                f"{config.max_share * world_size} samples, not the global batch of {global_batch_size}; raise "
                "max_share or lower the global batch")
        over = [r for r, n in enumerate(shares) if n > config.max_share]
        if over:
            raise HetrainError(
                f"rank {over[0]} starts at {shares[over[0]]} samples, above balance.max_share {config.max_share}; "
                "give the plan's shares within it (re-plan) or raise max_share")
    return BalanceSetup(shares, config)


def saved_split_outside(shares: list[int], config: BalancePlan) -> str | None:
    """Why a checkpoint's split cannot go on under this run's balance settings (a resume under a plan whose
    min_share or max_share changed), or None. Continued as saved, a rank stayed at 0 samples under a plan that
    gives every rank one (a model that cannot take an empty batch failed every restart), and a rank kept more
    samples than a max_share set as its memory's bound."""
    low = [r for r, n in enumerate(shares) if n < config.min_share]
    if low:
        return f"rank {low[0]} was at {shares[low[0]]} samples, below this run's balance.min_share {config.min_share}"
    high = [r for r, n in enumerate(shares) if config.max_share is not None and n > config.max_share]
    if high:
        return (f"rank {high[0]} was at {shares[high[0]]} samples, above this run's balance.max_share "
                f"{config.max_share}")
    return None


def piece_caps(shares: list[int], pieces: list[tuple[int | None, int]] | None) -> list[int | None] | None:
    """Each rank's most samples a re-split may give it, where every rank runs the job's count of micro-batches
    (`pieces`: each rank's (micro_batch, grad_accum); FSDP2 data parallelism, SyncBatchNorm), else None: those
    of one piece more than the starting split's count. There a rank's step also costs its pieces' fixed work
    (FSDP2 gathers every block's weights for each), the count follows the largest share, and the balancer's
    model of a rank (fixed + samples x cost) does not see it: moving samples to a fast rank gave every rank
    more pieces, the slow rank's time did not fall with its share, and the split ran to [47, 1] at 2x the step
    time of the plan's. Held at the starting count, a plan whose shares fill their pieces could not move at all
    (a slow rank at twice the time per sample kept [24, 24]): one piece more lets it move, and bounds what the
    count can cost. A rank whose count does not follow its share (no micro_batch) has no cap."""
    if pieces is None or all(mb is None for mb, _ in pieces):
        return None
    count = job_piece_count(shares, pieces) + 1
    return [count * mb if mb else None for mb, _ in pieces]
