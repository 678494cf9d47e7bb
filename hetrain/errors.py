"""Errors a user can hit. The CLI prints them as one line and exits non-zero."""

from collections.abc import Hashable, Iterable, Sequence


class HetrainError(ValueError):
    """A problem with the user's input: the message names the value, the reason and the fix."""


class NoPlanFits(HetrainError):
    """No plan of the strategies asked for fits the model on the cluster's devices (the message says
    how short the memory is and what to add); `shortfall`: "DEVICE is N GB short", where known."""

    def __init__(self, message: str, shortfall: str | None = None) -> None:
        super().__init__(message)
        self.shortfall = shortfall


def format_validation_error(e) -> str:
    """A pydantic ValidationError as one readable line: where, and what is wrong."""
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "document"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def ranks_text(ranks: Iterable[int]) -> str:
    """`rank 3` or `ranks 0,2`: how a message names ranks."""
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def ranks_by_value(values: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Each distinct value of `values` (one per rank, by rank) and the ranks that hold it, in first-seen order."""
    groups: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups
