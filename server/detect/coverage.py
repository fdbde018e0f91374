"""What a session did not compare, in sentences: the difference between "aligned" and "incomplete".

A verdict is only as good as what went into it.  A run that captured
nothing, failed for some modules, dropped steps, lost its connection or
ended before the others leaves parts of the training uncompared; each such
shortfall becomes one sentence of the report's ``status_reasons`` and keeps
the session from ending ``aligned``.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Protocol

from twinstep.v1 import twinstep_pb2 as pb

#: Ways a client lost steps that are its own doing, in words (others are shown by their key).
_DROP_WORDS = {
    "queue_full": "the send queue was full",
    "oversized": "a step was larger than a message may be",
    "sender_lost": "the sender process died",
    "server_rejected": "the server refused the run",
    "shutdown": "still queued when the run closed",
    "server_window": "the server's window overflowed while the other run lagged",
    "unmatched": "no counterpart step in the baseline",
}


class RankView(Protocol):
    state: str
    first_step: int
    last_step: int
    health: pb.CaptureHealth | None


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

    def steps_compared(self) -> int: ...

    def dropped_by_reason(self, run: RunView) -> dict[str, int]: ...


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
        by_phase[pb.Phase.Name(f.phase).lower()] += f.count
    modules = {f.name for f in entries if f.phase in _MODULE_PHASES}
    parameters = {f.name for f in entries if f.phase in (pb.GRAD, pb.PARAM)}
    owners = " and ".join(part for part in (_count(len(modules), "module"), _count(len(parameters), "parameter"))
                          if part) or "the loss"
    labels = list(dict.fromkeys(_label(f) for f in entries))
    names = ", ".join(map(repr, labels[:3])) + (", ..." if len(labels) > 3 else "")
    phases = ", ".join(f"{phase} {count}" for phase, count in by_phase.items())
    first = min(f.first_step for f in entries)
    last = max(f.last_step for f in entries)
    return (f"{sum(by_phase.values())} record(s) of {owners} not captured ({phases}; {names}; "
            f"{_span(first, last)}): {entries[0].error}")


def health_sentences(health: pb.CaptureHealth | None) -> list[str]:
    """Every kind of failure of one rank, one sentence each."""
    return [describe_failure(health, kind) for kind in failure_kinds(health)] if health is not None else []


def coverage_problems(session: _SessionView) -> list[str]:
    """Every reason the session's comparison does not cover both runs whole (empty: nothing missing)."""
    runs = list(session.runs.values())
    problems: list[str] = []
    if not runs:
        return ["no run has joined"]
    baseline = session.runs.get(session.baseline or "")
    candidates = [r for r in runs if not r.baseline and not r.reference]
    if baseline is None:
        problems.append("no baseline run joined (attach one run with baseline=True)")
    if not candidates:
        problems.append("no candidate run joined: nothing was compared against the baseline")
    for run in runs:
        problems.extend(_run_problems(run, session.dropped_by_reason(run)))
    ended = all(r.state in ("finished", "halted", "lost") for r in runs)
    if baseline is not None and ended and not session.halted:
        problems.extend(_ended_early(baseline, candidates))
    if baseline is not None and candidates and ended and session.steps_compared() == 0:
        problems.append("no step was compared on both sides")
    return problems


def _run_problems(run: RunView, dropped: dict[str, int]) -> list[str]:
    label = f"run {run.name!r}"
    out: list[str] = []
    for rank, state in sorted(run.ranks.items()):
        where = f"{label} rank {rank}" if len(run.ranks) > 1 else label
        if state.last_step < 0 and state.state != "streaming":
            why = health_sentences(state.health)
            out.append(f"{where} delivered no step" + (f": {why[0]}" if why else " (it ended before its first step() call, "
                                                                                "or every step was lost)"))
        elif state.health is not None:
            out.extend(f"{where}: {sentence}" for sentence in health_sentences(state.health))
        if state.state == "lost":
            out.append(f"{where} lost its connection after step {state.last_step} "
                       "(the process ended or the network failed before it closed)")
    if dropped:
        parts = ", ".join(f"{count} ({_DROP_WORDS.get(reason, reason)})" for reason, count in Counter(dropped).most_common())
        out.append(f"{label} lost {sum(dropped.values())} step(s): {parts}")
    return out


def _ended_early(baseline: RunView, candidates: Iterable[RunView]) -> list[str]:
    """Runs that stopped before the others: the steps past their end were never compared."""
    out = []
    for cand in candidates:
        if cand.last_step < 0 or baseline.last_step < 0:
            continue
        if cand.last_step < baseline.last_step:
            out.append(f"run {cand.name!r} ended at step {cand.last_step}, the baseline {baseline.name!r} at step "
                       f"{baseline.last_step}: steps {cand.last_step + 1} to {baseline.last_step} were not compared")
        elif baseline.last_step < cand.last_step:
            out.append(f"the baseline {baseline.name!r} ended at step {baseline.last_step}, run {cand.name!r} at step "
                       f"{cand.last_step}: steps {baseline.last_step + 1} to {cand.last_step} were not compared")
    return out


_MODULE_PHASES = (pb.FORWARD, pb.BACKWARD, pb.INPUT)


def _error_type(error: str) -> str:
    return error.split(":", 1)[0]


def _label(failure: pb.CaptureFailure) -> str:
    if failure.phase == pb.LOSS:
        return "loss"
    return failure.name or "(model)"


def _count(n: int, noun: str) -> str:
    return "" if not n else f"1 {noun}" if n == 1 else f"{n} {noun}s"


def _span(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first} to {last}"
