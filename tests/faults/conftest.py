"""Counts the fault and bad-input tests collect, printed at the end of the run."""

TALLY: dict[str, int] = {}


def count(name: str, n: int = 1) -> None:
    TALLY[name] = TALLY.get(name, 0) + n


def pytest_terminal_summary(terminalreporter) -> None:
    if TALLY:
        terminalreporter.write_line("hetrain faults: " + ", ".join(f"{k}: {v}" for k, v in TALLY.items()))
