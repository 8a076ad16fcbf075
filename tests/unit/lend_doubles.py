"""Test doubles of core lending: a thread team that records what it is asked, and a guard that
always borrows."""

from splitserve.serving.guard import PayoffGuard


class Recorder:
    """A ``ThreadTeam`` that records what the borrower asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_threads(self, n: int) -> None:
        self.calls.append(("threads", n))

    def grow(self, n: int, cores: set[int], home: set[int]) -> None:
        self.calls.append(("grow", n, sorted(cores), sorted(home)))


class Always(PayoffGuard):
    """A guard that always borrows and keeps what it was told."""

    def __init__(self) -> None:
        super().__init__("test")
        self.records: list[tuple[int, bool, float]] = []

    def use(self, size: int) -> bool:
        return True

    def record(self, size: int, used: bool, seconds: float) -> None:
        self.records.append((size, used, seconds))
