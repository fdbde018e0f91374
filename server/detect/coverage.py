"""What a session did not compare, in sentences: the difference between "aligned" and "incomplete".

A verdict is only as good as what went into it.  A run that captured
nothing, failed for some modules, dropped steps, lost its connection or
ended before the others leaves parts of the training uncompared; each such
shortfall becomes one sentence of the report's ``status_reasons`` and keeps
the session from ending ``aligned``.
"""

from __future__ import annotations

from collections import Counter
from typing import Collection, Mapping, Protocol

from twinstep.wire import phases
from twinstep.server.align.coverage import CoverageLedger
from twinstep.server.align.step_ranges import StepRanges
from twinstep.server.detect.gaps import MAX_LISTED_GAPS, Side, find_gaps
from twinstep.server.runs.membership import ENDED
from twinstep.server.detect.gaps import describe as describe_gaps
from twinstep.v1 import twinstep_pb2 as pb


class RankView(Protocol):
    state: str
    first_step: int
    last_step: int
    health: pb.CaptureHealth | None
    silent_for: float


class RunView(Protocol):
    name: str
    baseline: bool
    reference: bool
    ranks: Mapping[int, RankView]

    @property
    def state(self) -> str: ...

    @property
    def last_step(self) -> int: ...


class _SessionView(Protocol):
    halted: bool

    @property
    def runs(self) -> Mapping[str, RunView]: ...

    @property
    def baseline(self) -> str | None: ...

    def coverage_of(self, candidate: str) -> pb.Coverage: ...


def failure_kinds(health: pb.CaptureHealth | None) -> list[str]:
    """Distinct kinds of failure in a health snapshot: "step" for whole steps, then each error type of records."""
    if health is None:
        return []
    kinds = {"step": None} if health.failed_steps else {}
    kinds.update({"records:" + _error_type(f.error): None for f in health.failures})
    return list(kinds)


def describe_failure(health: pb.CaptureHealth, kind: str) -> str:
    """One sentence on one kind of failure (see :func:`failure_kinds`)."""
    if kind == "step":
        return (f"{health.failed_steps} whole step(s) not captured "
                f"({_span(health.first_failed_step, health.last_failed_step)}): {health.step_error}")
    error_type = kind.split(":", 1)[1]
    entries = [f for f in health.failures if _error_type(f.error) == error_type]
    by_phase = Counter[str]()
    for f in entries:
        by_phase[phases.describe(f.phase)] += f.count
    modules = {f.name for f in entries if f.phase in phases.MODULE_PHASES}
    parameters = {f.name for f in entries if f.phase in phases.PARAM_PHASES}
    owners = " and ".join(part for part in (_count(len(modules), "module"), _count(len(parameters), "parameter"))
                          if part) or "the loss"
    labels = list(dict.fromkeys(_label(f) for f in entries))
    names = ", ".join(map(repr, labels[:3])) + (", ..." if len(labels) > 3 else "")
    counts = ", ".join(f"{phase} {count}" for phase, count in by_phase.items())
    first = min(f.first_step for f in entries)
    last = max(f.last_step for f in entries)
    return (f"{sum(by_phase.values())} record(s) of {owners} not captured ({counts}; {names}; "
            f"{_span(first, last)}): {entries[0].error}")


def health_sentences(health: pb.CaptureHealth | None) -> list[str]:
    """Every kind of failure of one rank, one sentence each."""
    return [describe_failure(health, kind) for kind in failure_kinds(health)] if health is not None else []


def describe_coverage(ledger: CoverageLedger, candidate: str, sides: list[tuple[int, Side, Side]],
                      steps_compared: int) -> pb.Coverage:
    """A candidate's coverage: compared steps as ranges, the gaps up to where both runs have got, and one sentence.

    ``sides``: (rank, baseline, candidate) of every rank both runs have.  While
    either run streams, steps past the slower one are not gaps yet; once both
    ended, steps past the one that ended first are.
    """
    out = pb.Coverage(candidate_run=candidate, steps_compared=steps_compared)
    if not sides:
        out.summary = "nothing compared yet"
        return out
    rank0, base0, cand0 = sides[0]
    compared = ledger.compared_steps(candidate, rank0)
    for first, last in list(compared)[:MAX_LISTED_GAPS]:
        out.compared.add(first=first, last=last)
    declared = base0.coverage.declared.words(base0.name) + cand0.coverage.declared.words(candidate)
    out.declared.extend(declared)
    for rank, base, cand in sides:
        reach = [_reach(base), _reach(cand)]
        # While a run streams, steps past the slower one are not gaps yet; once both ended, they are.
        last = max(reach) if base.ended and cand.ended else min(reach)
        if last < 0:
            continue
        gaps, unlisted = find_gaps(ledger, base, cand, rank, last)
        out.gaps.extend(gaps[: MAX_LISTED_GAPS - len(out.gaps)])
        out.gaps_unlisted += unlisted + max(0, len(gaps) - MAX_LISTED_GAPS)
    out.summary = _summary(out, compared)
    return out


def _reach(side: Side) -> int:
    """The highest step a run has accounted for: delivered, or said to be missing (-1: none)."""
    lasts = [side.coverage.delivered.last] + [ranges.last for ranges in side.coverage.missing.values()]
    return max((last for last in lasts if last is not None), default=-1)


def _summary(coverage: pb.Coverage, compared: StepRanges) -> str:
    if not compared.count():
        head = "nothing compared"
    else:
        spans = ", ".join(_span(first, last) for first, last in list(compared)[:4]) + (", ..." if len(compared) > 4 else "")
        head = f"compared {spans} ({coverage.steps_compared} step(s))"
    if coverage.declared:
        head += "; declared not captured: " + "; ".join(coverage.declared)
    if coverage.gaps or coverage.gaps_unlisted:
        head += "; not compared: " + describe_gaps(list(coverage.gaps), coverage.gaps_unlisted)
    return head


def coverage_problems(session: _SessionView, only: str | None = None,
                      halted_runs: Collection[str] = ()) -> list[str]:
    """Every reason the session's comparison does not cover both runs whole (empty: nothing missing).

    ``only``: the reasons of one candidate's comparison (its run's, the baseline's and the
    references'), for its own verdict in a session with several.  ``halted_runs``: candidates
    halted alone (twinstep.server.runs.halt), whose steps after the halt are missing on purpose.
    """
    runs = list(session.runs.values())
    problems: list[str] = []
    if not runs:
        return ["no run has joined"]
    if only is not None:
        runs = [r for r in runs if r.baseline or r.reference or r.name == only]
    baseline = session.runs.get(session.baseline or "")
    candidates = [r for r in runs if not r.baseline and not r.reference]
    if baseline is None:
        problems.append("no baseline run joined (attach one run with baseline=True)")
    if not candidates:
        problems.append("no candidate run joined: nothing was compared against the baseline")
    for run in runs:
        problems.extend(_run_problems(run))
    ended = all(r.state in ENDED for r in runs)
    if baseline is None:
        return problems
    for cand in candidates:
        coverage = session.coverage_of(cand.name)
        if coverage.gaps or coverage.gaps_unlisted:
            stopped = any(r.state == "halted" for r in (baseline, cand))  # a halt that reached no run excuses nothing
            if ((session.halted or cand.name in halted_runs) and stopped
                    and all(g.reason.startswith(f"run {g.run!r} ended") for g in coverage.gaps)):
                continue  # a halt stops the runs at different steps on purpose
            problems.append(f"run {cand.name!r}: not compared: "
                            f"{describe_gaps(list(coverage.gaps), coverage.gaps_unlisted, limit=4)}")
        if ended and coverage.steps_compared == 0:
            problems.append(f"run {cand.name!r}: no step was compared on both sides")
    return problems


def candidate_verdict(session: _SessionView, candidate: str, diverged: bool,
                      halted_runs: Collection[str] = ()) -> tuple[str, list[str]]:
    """One candidate's own verdict (running | aligned | diverged | incomplete) and its reasons.

    The session's rule (Session.status_and_reasons) applied to one candidate's comparison: its
    first divergence, and the runs it depends on (the baseline, the references and itself).  A
    session with several candidates is ``diverged`` when any is, while another may be ``aligned``.
    """
    reasons = coverage_problems(session, only=candidate, halted_runs=halted_runs)
    if diverged:
        return "diverged", reasons
    involved = [r for r in session.runs.values() if r.baseline or r.reference or r.name == candidate]
    if any(r.state not in ENDED for r in involved):
        return "running", reasons
    return ("incomplete" if reasons else "aligned"), reasons


def _run_problems(run: RunView) -> list[str]:
    """Per rank: nothing delivered, records not captured, a lost connection (steps missing are gaps)."""
    label = f"run {run.name!r}"
    out: list[str] = []
    for rank, state in sorted(run.ranks.items()):
        where = f"{label} rank {rank}" if len(run.ranks) > 1 else label
        sentences = health_sentences(state.health)
        if state.last_step < 0 and state.state != "streaming":
            out.append(f"{where} delivered no step" + (f": {sentences[0]}" if sentences else
                                                       " (it ended before its first step() call, or every step was lost)"))
        else:
            out.extend(f"{where}: {sentence}" for sentence in sentences if "whole step(s)" not in sentence)
        if state.state == "lost":
            silent = f", {state.silent_for:.1f} s after its last message" if state.silent_for >= 0 else ""
            out.append(f"{where} lost its connection after step {state.last_step}{silent} "
                       "(the process ended or the network failed before it closed)")
    return out



def _error_type(error: str) -> str:
    return error.split(":", 1)[0]


def _label(failure: pb.CaptureFailure) -> str:
    if failure.phase == phases.LOSS:
        return "loss"
    return failure.name or "(model)"


def _count(n: int, noun: str) -> str:
    return "" if not n else f"1 {noun}" if n == 1 else f"{n} {noun}s"


def _span(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first} to {last}"
