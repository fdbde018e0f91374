"""What a shard tells the coordinator about a session: small, plain, once per poll.

One call per shard per poll carries every session's digest (a few hundred
bytes each), so what crosses between actors grows with sessions and runs,
never with records or steps.  Built under the session's lock from its core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twinstep.server.detect.first_divergence import Candidate
from twinstep.server.session import verdict

if TYPE_CHECKING:
    from twinstep.server.session.core import SessionCore


def divergence_of(found: Candidate) -> dict[str, Any]:
    row = found.row
    return {"key": tuple(found.key), "step": found.comparison.step, "rank": found.comparison.rank,
            "phase": row.phase, "module": row.name, "after_gap": found.after_gap}


def _proto(core: "SessionCore", found: Candidate) -> bytes:
    """The divergence as the shard's own event tells it (the coordinator publishes it once it is final)."""
    divergence = found.to_proto()
    divergence.merged_from = core.pipeline.merged_from(found.comparison.candidate_run, found.row)
    return divergence.SerializeToString()


def of_core(core: "SessionCore") -> dict[str, Any]:
    """The digest of one session (the caller holds its lock)."""
    pipeline = core.pipeline
    tracker = pipeline.tracker
    runs = {}
    for run in core.members.ordered():
        layout = run.layout
        runs[run.name] = {
            "baseline": run.baseline, "reference": run.reference, "world_size": run.world_size,
            "shape": tuple(layout.shape) if layout is not None else (run.world_size,),
            "layout_text": layout.text() if layout is not None else "",
            "joined": sorted(run.ranks), "ended": run.ended,
        }
    best = {name: divergence_of(found) for name, found in tracker.pending().items()}
    status, _ = verdict.status_and_reasons(core)
    return {
        "baseline": core.baseline, "candidates": list(core.candidates), "runs": runs,
        "frontier": pipeline.frontier(),
        "compared": {name: list(pipeline.compared_ranks(name)) for name in core.candidates},
        "declared": {name: dict(divergence_of(found), proto=_proto(core, found))
                     for name, found in tracker.declared.items()},
        "best": best, "halted": core.halted, "status": status, "layout_mode": pipeline.layout_mode or "",
        "steps_compared": pipeline.steps_compared(),
    }
