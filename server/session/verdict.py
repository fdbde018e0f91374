"""A session's verdict, and the words it is told in once every run has ended."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinstep.server.detect.coverage import candidate_verdict, coverage_problems

if TYPE_CHECKING:
    from twinstep.server.session.core import SessionCore


def status_and_reasons(core: "SessionCore") -> tuple[str, list[str]]:
    """The verdict, and every shortfall of coverage in sentences.

    ``diverged`` as soon as a first divergence is declared.  Once every run
    has ended: ``aligned`` only when something was compared and nothing
    went missing; otherwise ``incomplete``, with the reasons.  A session
    never stays ``running`` after its runs have ended.  With several
    candidates: ``diverged`` when any candidate diverged; each
    candidate's own verdict is in its report section (candidate_verdict).
    """
    reasons = coverage_problems(core, halted_runs=core.halts.runs_halted)
    if core.pipeline.tracker.first() is not None:
        return "diverged", reasons
    if not core.members.all_ended():
        return "running", reasons
    return ("incomplete" if reasons else "aligned"), reasons


def of_candidate(core: "SessionCore", candidate: str) -> tuple[str, list[str]]:
    """One candidate's own verdict (its section of the report)."""
    diverged = candidate in core.pipeline.tracker.declared
    return candidate_verdict(core, candidate, diverged, core.halts.runs_halted)


def ended_words(core: "SessionCore") -> tuple[str, str] | None:
    """(level, message) telling that every run has ended without a divergence; None when one diverged."""
    status, reasons = status_and_reasons(core)
    if status == "diverged":
        return None
    if status == "aligned":
        return "info", f"every run has ended: aligned over {core.pipeline.steps_compared()} compared step(s)"
    config = core.config
    more = f" (and {len(reasons) - 3} more: see the report)" if len(reasons) > 3 else ""
    if not core.candidates:  # the baseline may simply have been started first: say what a late candidate gets
        more += (f"; a candidate that joins within session_ttl ({config.sessions.ttl:g} s) is still compared "
                 f"with the last {config.window.steps} step(s) the server holds of each run, and the verdict "
                 "is told again when it ends")
    return "warning", f"every run has ended: {status.upper()}: " + "; ".join(reasons[:3]) + more
