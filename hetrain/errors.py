"""Errors a user can hit. The CLI prints them as one line and exits non-zero."""


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
