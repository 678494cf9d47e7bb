"""An observer that keeps every StepRecord a session reports (session.add_observer), for the timing tests."""


class StepRecords:
    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)
