"""Which steps a candidate's comparison did not cover, and why: the gaps a first divergence may hide behind.

A step is covered when it was compared on both sides, or when either run
declared it does not capture it (``every``).  Every other step up to the
point in question is a gap, named with the run whose data is missing and the
reason: what that run's client said (capture failed, queue full, ...), what
this server dropped, or, when nobody said, that the run had not started or
did not deliver it.  Phases with records missing inside compared steps are
gaps too, of that phase only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from twinstep.wire.phases import step_position
from twinstep.server.align.coverage import CoverageLedger, RankCoverage
from twinstep.server.align.step_ranges import StepRanges
from twinstep.v1 import twinstep_pb2 as pb

#: Steps looked at one by one in one call, at most (each uncompared step costs a few dict look-ups).
MAX_SCANNED_STEPS = 2_000_000
#: Gaps listed in one answer, at most; the rest are counted.
MAX_LISTED_GAPS = 64


#: Reasons a client or this server gives, in words.
REASON_WORDS = {
    "capture_failed": "capture failed",
    "queue_full": "dropped: the send queue was full (the server was slow or away)",
    "oversized": "dropped: larger than a message may be",
    "shutdown": "still queued when the run closed",
    "sender_lost": "the sender process died",
    "server_rejected": "the server refused the run",
    "server_window": "dropped by the server: its window overflowed while the other run lagged",
    "not_started": "not run: it started later",
    "not_delivered": "never delivered, and the client gave no reason (the process may have died)",
    "ended": "not run: it ended earlier",
}


@dataclass(frozen=True)
class Side:
    """One of the two runs compared."""

    name: str
    coverage: RankCoverage
    ended: bool


def find_gaps(ledger: CoverageLedger, baseline: Side, candidate: Side, rank: int, last_step: int,
              phase: str | None = None) -> tuple[list[pb.Gap], int]:
    """Gaps of one rank over steps 0..last_step; with ``phase``, step last_step counts only up to that phase.

    Returns (gaps, how many more were found than listed).
    """
    compared = ledger.compared_steps(candidate.name, rank)
    whole_last = last_step - 1 if phase is not None else last_step
    gaps: list[pb.Gap] = []
    unlisted = 0
    scanned = 0
    for first, last in compared.missing_in(0, whole_last):
        for gap in _classify(baseline, candidate, rank, first, last):
            if len(gaps) < MAX_LISTED_GAPS:
                gaps.append(gap)
            else:
                unlisted += 1
        scanned += last - first + 1
        if scanned > MAX_SCANNED_STEPS:
            break
    for gap in _phase_gaps(baseline, candidate, rank, compared, last_step, phase):
        if len(gaps) < MAX_LISTED_GAPS:
            gaps.append(gap)
        else:
            unlisted += 1
    gaps.sort(key=lambda g: (g.first_step, g.phase != "", g.run))
    return gaps, unlisted


def _classify(baseline: Side, candidate: Side, rank: int, first: int, last: int) -> Iterable[pb.Gap]:
    """Uncompared steps first..last as gaps, declared steps left out; runs of one cause merged."""
    open_gap: pb.Gap | None = None
    for step in range(first, last + 1):
        if not (baseline.coverage.declared.captures(step) and candidate.coverage.declared.captures(step)):
            if step < max(baseline.coverage.declared.start_step, candidate.coverage.declared.start_step):
                cause = _not_started(baseline, candidate, step)
            else:
                continue  # declared not captured (every N): a chosen gap, not a hole
        else:
            cause = _cause(candidate, step) or _cause(baseline, step) or ("", "compared on neither side", "")
        run, reason, detail = cause
        if open_gap is not None and (open_gap.run, open_gap.reason) == (run, _words(reason, detail)):
            open_gap.last_step = step
            continue
        if open_gap is not None:
            yield open_gap
        open_gap = pb.Gap(run=run, rank=rank, first_step=step, last_step=step, reason=_words(reason, detail))
    if open_gap is not None:
        yield open_gap


def _not_started(baseline: Side, candidate: Side, step: int) -> tuple[str, str, str]:
    later = candidate if candidate.coverage.declared.start_step > step else baseline
    return later.name, "not_started", f"run {later.name!r} started at step {later.coverage.declared.start_step}"


def _cause(side: Side, step: int) -> tuple[str, str, str] | None:
    """Why ``side`` has no step ``step`` (None: it delivered it)."""
    coverage = side.coverage
    reason = coverage.why_missing(step)
    if reason is not None:
        return side.name, reason, coverage.details.get(reason, "")
    if step in coverage.delivered:
        return None
    first = coverage.delivered.first
    if first is None or step < first:
        if first is None and not side.ended:
            return side.name, "not_delivered", "nothing delivered yet"
        return side.name, "not_started", (f"run {side.name!r} delivered its first step at {first}" if first is not None
                                           else f"run {side.name!r} delivered no step")
    last = coverage.delivered.last
    if side.ended and last is not None and step > last:
        return side.name, "ended", f"run {side.name!r} ended at step {last}"
    return side.name, "not_delivered", ""


def _phase_gaps(baseline: Side, candidate: Side, rank: int, compared: StepRanges, last_step: int,
                phase: str | None) -> Iterable[pb.Gap]:
    """Compared steps with records missing in some phase, up to (step, phase); consecutive steps merged."""
    limit = step_position(phase or "")
    for side in (candidate, baseline):
        open_gaps: dict[str, pb.Gap] = {}
        for step, phases in sorted(side.coverage.incomplete.items()):
            if step > last_step or step not in compared:
                continue
            for name in phases:
                if step == last_step and phase is not None and step_position(name) >= limit:
                    continue
                gap = open_gaps.get(name)
                if gap is not None and gap.last_step == step - 1:
                    gap.last_step = step
                    continue
                if gap is not None:
                    yield gap
                open_gaps[name] = pb.Gap(run=side.name, rank=rank, first_step=step, last_step=step, phase=name,
                                         reason="some records not captured (see the run's capture health)")
        yield from open_gaps.values()


def _words(reason: str, detail: str) -> str:
    words = REASON_WORDS.get(reason, reason)
    if reason in ("not_started", "ended") and detail:
        return detail
    return f"{words}: {detail}" if detail else words


def describe(gaps: list[pb.Gap], unlisted: int = 0, limit: int = 3) -> str:
    """Gaps in one phrase: "steps 0 to 12 (run 'paddle': capture failed: ...)"."""
    parts = []
    for gap in gaps[:limit]:
        steps = f"step {gap.first_step}" if gap.first_step == gap.last_step else f"steps {gap.first_step} to {gap.last_step}"
        if gap.phase:
            steps += f" ({gap.phase} only)"
        who = f"run {gap.run!r}: " if gap.run and not gap.reason.startswith(f"run {gap.run!r}") else ""
        rank = f" rank {gap.rank}" if gap.rank else ""
        parts.append(f"{steps}{rank} ({who}{gap.reason})")
    more = len(gaps) - limit + unlisted
    return "; ".join(parts) + (f"; and {more} more gap(s)" if more > 0 else "")
