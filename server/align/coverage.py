"""What each run delivered, declared, and said it missed, per rank and step: the facts gaps are judged from.

A first divergence at step k is only first if every step before it was
compared on both sides, or was declared not captured by the runs (``every``,
a later ``start_step``).  This ledger keeps the facts; the judgement (which
steps are gaps, and why, in words) is :mod:`twinstep.server.detect.coverage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twinstep.wire import phases
from twinstep.server.align.step_ranges import StepRanges
from twinstep.v1 import twinstep_pb2 as pb

#: Steps whose incomplete phases are remembered per run and rank (the earliest; later ones are counted).
MAX_INCOMPLETE_STEPS = 10_000


@dataclass
class Declared:
    """What a run said, in its Hello, that it does not capture."""

    every: int = 1
    start_step: int = 0
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()

    @classmethod
    def of(cls, hello: pb.Hello) -> "Declared":
        return cls(every=max(hello.every, 1), start_step=max(hello.start_step, 0),
                   include=tuple(hello.include) or ("*",), exclude=tuple(hello.exclude))

    def captures(self, step: int) -> bool:
        return step >= self.start_step and step % self.every == 0

    def words(self, run: str) -> list[str]:
        """The declarations in sentences (empty when the run captures everything)."""
        out = []
        if self.every > 1:
            out.append(f"run {run!r} captures every {self.every} steps (every={self.every})")
        if self.include != ("*",):
            out.append(f"run {run!r} captures only modules matching {list(self.include)}")
        if self.exclude:
            out.append(f"run {run!r} leaves out modules matching {list(self.exclude)}")
        return out


@dataclass
class RankCoverage:
    """One rank of one run."""

    declared: Declared = field(default_factory=Declared)
    delivered: StepRanges = field(default_factory=StepRanges)
    missing: dict[str, StepRanges] = field(default_factory=dict)
    """Steps the client or this server says are missing, by reason."""
    details: dict[str, str] = field(default_factory=dict)
    """The first detail given for each reason (an error message)."""
    unlisted: int = 0
    """Missing steps the client counted but could not list."""
    incomplete: dict[int, set[str]] = field(default_factory=dict)
    """step -> phases in which some record was not captured."""
    incomplete_unlisted: int = 0

    def mark_missing(self, first: int, last: int, reason: str, detail: str = "") -> None:
        self.missing.setdefault(reason, StepRanges()).add(first, last)
        if detail and reason not in self.details:
            self.details[reason] = detail[:500]

    def why_missing(self, step: int) -> str | None:
        for reason, ranges in self.missing.items():
            if step in ranges:
                return reason
        return None


class CoverageLedger:
    """Coverage of every run and rank of one session, and what each candidate compared."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], RankCoverage] = {}
        self._compared: dict[tuple[str, int], StepRanges] = {}

    def rank(self, run: str, rank: int) -> RankCoverage:
        found = self._ranks.get((run, rank))
        if found is None:
            found = self._ranks[(run, rank)] = RankCoverage()
        return found

    def known(self, run: str, rank: int) -> bool:
        return (run, rank) in self._ranks

    def declare(self, run: str, rank: int, hello: pb.Hello) -> None:
        self.rank(run, rank).declared = Declared.of(hello)

    def delivered(self, run: str, rank: int, step: int, incomplete: list[int]) -> None:
        coverage = self.rank(run, rank)
        coverage.delivered.add(step)
        if incomplete:
            if len(coverage.incomplete) < MAX_INCOMPLETE_STEPS:
                coverage.incomplete[step] = {phases.describe(p) for p in incomplete}
            else:
                coverage.incomplete_unlisted += 1

    def client_missing(self, run: str, rank: int, health: pb.CaptureHealth) -> None:
        """The client's list of steps it did not deliver (cumulative: merged in)."""
        coverage = self.rank(run, rank)
        for item in health.missing:
            if item.last_step >= item.first_step >= 0:
                coverage.mark_missing(item.first_step, item.last_step, item.reason or "unknown", item.detail)
        coverage.unlisted = max(coverage.unlisted, health.missing_unlisted)

    def server_dropped(self, run: str, rank: int, steps: list[int]) -> None:
        """Steps this server discarded from its window while the other run lagged."""
        coverage = self.rank(run, rank)
        for step in steps:
            coverage.mark_missing(step, step, "server_window")

    def compared(self, candidate: str, rank: int, step: int) -> None:
        self._compared.setdefault((candidate, rank), StepRanges()).add(step)

    def compared_steps(self, candidate: str, rank: int) -> StepRanges:
        return self._compared.get((candidate, rank)) or StepRanges()
