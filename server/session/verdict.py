"""A session's verdict, and the words it is told in once every run has ended (or that it still waits for a run)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinstep.server.detect.coverage import candidate_verdict, coverage_problems

if TYPE_CHECKING:
    from twinstep.server.session.core import SessionCore


#: coverage_problems' sentences for a side that never joined: a waiting session says what it waits for instead.
_NOBODY = ("no baseline run joined", "no candidate run joined")


def status_and_reasons(core: "SessionCore", final: bool = False) -> tuple[str, list[str]]:
    """The verdict, and every shortfall of coverage in sentences.

    ``diverged`` as soon as a first divergence is declared.  Once every run
    has ended: ``waiting`` while the session lacks a baseline or a candidate
    and one can still join (within sessions.ttl: a verdict then could still
    change, so none is given); otherwise ``aligned`` only when something was
    compared and nothing went missing, else ``incomplete``, with the
    reasons.  ``final``: no run can join any more (the session's time to live
    is over).  A session never stays ``running`` after its runs have ended.
    With several candidates: ``diverged`` when any candidate diverged; each
    candidate's own verdict is in its report section (candidate_verdict).
    """
    reasons = coverage_problems(core, halted_runs=core.halts.runs_halted)
    if core.pipeline.tracker.first() is not None:
        return "diverged", reasons
    if not core.members.all_ended():
        return "running", reasons
    waiting = None if final else waiting_for(core)
    if waiting is not None:
        return "waiting", [waiting] + [r for r in reasons if not r.startswith(_NOBODY)]
    return ("incomplete" if reasons else "aligned"), reasons


def of_candidate(core: "SessionCore", candidate: str, final: bool = False) -> tuple[str, list[str]]:
    """One candidate's own verdict (its section of the report)."""
    diverged = candidate in core.pipeline.tracker.declared
    status, reasons = candidate_verdict(core, candidate, diverged, core.halts.runs_halted)
    waiting = None if final or diverged else waiting_for(core)
    if waiting is not None:
        return "waiting", [waiting] + [r for r in reasons if not r.startswith(_NOBODY)]
    return status, reasons


def waiting_for(core: "SessionCore") -> str | None:
    """What a session whose runs have all ended waits for, while it lacks a side and one can still join.

    None once it has a baseline and a candidate, while a run streams, after a halt (a run that joins is
    halted at once), once the server holds none of the steps a run joining now would be compared with, and
    once it left the registry.
    """
    if core.halted or core.archived or not core.members.all_ended():
        return None
    if core.baseline is None:
        side, kept, verdict_after = "the baseline", core.members.compared_runs, "it has run"
    elif not core.candidates:
        side, kept, verdict_after = "a candidate", [core.baseline], "one has run"
    else:
        return None
    words = _kept_words(core, kept)
    if words is None:
        return None  # nothing held any more (the memory budget freed it): a run joining now has nothing to meet
    who = "baseline" if core.baseline is None else "candidate"
    return (f"waiting for {side} to join ({words}); the verdict is told once {verdict_after}, and is "
            f"final if no {who} joins within sessions.ttl ({core.config.sessions.ttl:g} s)")


def _kept_words(core: "SessionCore", runs: list[str]) -> str | None:
    """"the 6 steps of candidate 'paddle' are kept for it": what a run that joins now is still compared with
    (None: the server holds none of their steps)."""
    parts, held_total = [], 0
    for name in runs:
        run = core.runs[name]
        role = "baseline" if run.baseline else "reference" if run.reference else "candidate"
        held = max((core.pipeline.pending_steps(name, rank) for rank in run.ranks), default=0)
        delivered = max((core.coverage.rank(name, rank).delivered.count() for rank in run.ranks), default=0)
        held_total += held
        if held == 0:
            continue
        if held < delivered:
            parts.append(f"the last {held} of the {delivered} steps of {role} {name!r}")
        else:
            parts.append(f"the {held} step{'s' if held != 1 else ''} of {role} {name!r}")
    if not parts:
        return None
    return " and ".join(parts) + (" is" if len(parts) == 1 and held_total == 1 else " are") + " kept for it"


def ended_words(core: "SessionCore") -> tuple[str, str] | None:
    """(level, message) once every run has ended without a divergence; None when one diverged.

    A session that waits for its baseline or a candidate says so, as information: its verdict can
    still change, so none is told until it is final (final_words)."""
    waiting = waiting_for(core)
    if waiting is not None:
        return "info", waiting
    status, reasons = status_and_reasons(core)
    if status == "diverged":
        return None
    if status == "aligned":
        return "info", f"every run has ended: aligned over {core.pipeline.steps_compared()} compared step(s)"
    more = f" (and {len(reasons) - 3} more: see the report)" if len(reasons) > 3 else ""
    return "warning", f"every run has ended: {status.upper()}: " + "; ".join(reasons[:3]) + more


def final_words(core: "SessionCore") -> tuple[str, str]:
    """(level, message) when a waiting session's time to live is over and its verdict becomes final."""
    status, reasons = status_and_reasons(core, final=True)
    who = "baseline" if core.baseline is None else "candidate"
    more = f" (and {len(reasons) - 3} more: see the report)" if len(reasons) > 3 else ""
    return ("info" if status == "aligned" else "warning",
            f"no {who} joined within sessions.ttl ({core.config.sessions.ttl:g} s): the verdict is final: "
            f"{status.upper()}: " + "; ".join(reasons[:3]) + more)
