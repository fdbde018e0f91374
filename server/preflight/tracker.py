"""A session's set-ups and the findings they give: kept per run, diffed again whenever one changes.

A run's set-up is its lowest rank's (ranks of one run share it; a rank that
differs is a distributed bug the comparison itself shows).  Findings are
recomputed for every candidate when the baseline's or its own set-up
arrives, and when the candidate's mapping changes (automatic matching at its
first compared step).  Each warning is announced once per session.
"""

from __future__ import annotations

from typing import Callable, Iterable

from twinstep.server.compare.mapping import NameMapping
from twinstep.server.preflight.diff import diff_setups
from twinstep.v1 import twinstep_pb2 as pb


def _identity(f: pb.PreflightFinding) -> tuple[str, str, str, str, str]:
    return (f.candidate_run, f.category, f.key, f.baseline, f.candidate)


class PreflightTracker:
    """Set-ups by run and the current findings by candidate (call under the session's lock)."""

    def __init__(self) -> None:
        self.setups: dict[str, pb.Setup] = {}
        self.findings: dict[str, list[pb.PreflightFinding]] = {}
        self._told: set[tuple[str, str, str, str, str]] = set()

    def add(self, run: str, setup: pb.Setup) -> bool:
        """Keep ``setup`` as ``run``'s (a lower or the same rank replaces it); True when it changed."""
        held = self.setups.get(run)
        if held is not None and (setup.rank > held.rank or held.digest == setup.digest and setup.digest):
            return False
        self.setups[run] = setup
        return True

    def refresh(self, baseline: str | None, candidates: Iterable[str],
                mapping_for: Callable[[str, dict[str, str]], NameMapping]) -> list[pb.PreflightFinding]:
        """Diff every candidate that has a set-up against the baseline's; returns warnings not announced yet."""
        base = self.setups.get(baseline or "")
        if base is None:
            return []
        news = []
        for run in candidates:
            cand = self.setups.get(run)
            if cand is None:
                continue
            mapping = mapping_for(run, {m.name: m.type for m in cand.modules})
            findings = diff_setups(base, cand, mapping, run)
            self.findings[run] = findings
            for finding in findings:
                if finding.severity == "warning" and _identity(finding) not in self._told:
                    self._told.add(_identity(finding))
                    news.append(finding)
        return news

    def to_proto(self, candidates: Iterable[str]) -> list[pb.PreflightFinding]:
        return [f for run in candidates for f in self.findings.get(run, [])]
