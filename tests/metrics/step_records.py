"""An observer that keeps every StepRecord a session reports (session.add_observer), for the timing tests."""


class StepRecords:
    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)

    def totals(self, slept_per_step: float = 0.0) -> dict[str, float]:
        """Over the timed steps (the first has no step time): what the script slept on purpose, and the session's
        compute, waiting-on-ranks and script seconds."""
        timed = [r for r in self.records if r.step_seconds is not None]
        return {"slept": slept_per_step * len(timed), "compute": sum(r.compute_seconds for r in timed),
                "ranks": sum(r.waiting_seconds for r in timed), "script": sum(r.script_seconds for r in timed)}


def assert_the_wait_is_not_compute(fast: dict[str, float], slow: dict[str, float]) -> None:
    """The slow rank's sleep is its compute; the fast rank's wait for it is waiting on ranks, not its compute."""
    slept = slow["slept"]
    assert slow["compute"] >= 0.8 * slept, slow
    assert fast["compute"] < 0.5 * slept and fast["ranks"] >= 0.4 * slept, (fast, slept)
