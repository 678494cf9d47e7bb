"""Errors a user can hit. The CLI prints them as one line and exits non-zero."""


class HetrainError(ValueError):
    """A problem with the user's input: the message names the value, the reason and the fix."""
