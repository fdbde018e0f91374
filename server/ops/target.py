"""Which module's operations to capture after a divergence: the module whose own code the culprit points at.

A forward divergence whose module's input matches is created by that module
(its own code, or a child's, which then diverges first and is the one
named); one whose input already differs comes from code no hooked module
covers, in its parent's forward (twinstep.server.detect.culprit).  Either way
the module named here is the one whose forward holds the inline operations.
A data divergence (the stage says "data": the step's very first module already
differs, its input too when it was captured) points at the inputs the runs were
fed, which no module's operations hold: nothing is captured for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinstep.server.control.names import parent
from twinstep.server.detect.stage import describe

if TYPE_CHECKING:
    from twinstep.server.detect.first_divergence import Candidate


def ops_target(found: "Candidate") -> tuple[str, str] | None:
    """(baseline name, candidate name) of the module to capture, or None (not a forward divergence, the root,
    a data divergence)."""
    row, comparison = found.row, found.comparison
    if row.phase != "forward" or not row.name:
        return None
    if describe(row, comparison, found.previous_params).startswith("data"):
        return None  # the inputs differ before any module runs: no module's operations hold the cause
    candidate = row.candidate_name or row.name
    input_row = next((r for r in comparison.rows if r.phase == "input" and r.name == row.name
                      and r.call_index == row.call_index), None)
    if input_row is not None and input_row.divergent:
        base, candidate = parent(row.name), parent(candidate)
        if not base:
            return None  # the model's own forward: no module name to ask for ("" means none)
        return base, candidate
    return row.name, candidate
