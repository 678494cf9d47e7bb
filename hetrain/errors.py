"""Errors a user can hit. The CLI prints them as one line and exits non-zero."""


class HetrainError(ValueError):
    """A problem with the user's input: the message names the value, the reason and the fix."""


class NoPlanFits(HetrainError):
    """No plan of the strategies asked for fits the model on the cluster's devices (the message says
    how short the memory is and what to add); `shortfall`: "DEVICE is N GB short", where known."""

    def __init__(self, message: str, shortfall: str | None = None) -> None:
        super().__init__(message)
        self.shortfall = shortfall
