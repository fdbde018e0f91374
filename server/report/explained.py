"""Join the preflight findings to the diagnosis: which set-up difference a divergence goes through.

A preflight finding names modules or parameters ("norm epsilon differs for 1
module: norm").  When a candidate's first divergence (its origin, the path to
its crossing, the crossing, or the records an origin involves) touches one of
them, the divergence lists the finding as what explains it, and the finding
says so.  A finding that can change the numerics and that nothing in the
diagnosis explains is marked "not yet explained", so the report never leaves a
named cause and a contradicting diagnosis side by side without saying which is
which.
"""

from __future__ import annotations

from twinstep.v1 import twinstep_pb2 as pb


def join(findings: list[pb.PreflightFinding], divergences: dict[str, pb.Divergence]) -> None:
    """Fill ``explained_by`` of each candidate's divergence and ``explained``/``explanation`` of each finding."""
    for finding in findings:
        divergence = divergences.get(finding.candidate_run)
        touched = _touched(divergence) if divergence is not None else {}
        hit = next(((name, where) for name, where in touched.items() if _names(finding, name)), None)
        if hit is not None and divergence is not None:
            name, where = hit
            finding.explained = True
            finding.explanation = (f"explains the first divergence of {finding.candidate_run!r}: {where} "
                                   f"{name or '(model)'!r} at step {divergence.step}")
            divergence.explained_by.append(pb.ExplainedFinding(
                category=finding.category, key=finding.key, baseline=finding.baseline, candidate=finding.candidate,
                module=name, message=finding.message))
        elif finding.severity == "warning":
            finding.explained = False
            finding.explanation = (
                "not yet explained: no divergence so far" if divergence is None else
                f"not yet explained: the first divergence of {finding.candidate_run!r} (step {divergence.step}, "
                f"{divergence.phase} of {divergence.module or '(model)'!r}) and its path touch none of "
                "what it names")


def _touched(d: pb.Divergence) -> dict[str, str]:
    """Names the diagnosis goes through -> in which role (first one wins)."""
    touched: dict[str, str] = {}
    role = "its origin" if d.HasField("origin") else "the divergence at"
    touched.setdefault(d.module, role)
    for name in d.origin.involved:
        touched.setdefault(name, "the origin's record")
    for step in d.path:
        touched.setdefault(step.module, "the path through")
    if d.HasField("crossed"):
        touched.setdefault(d.crossed.module, "the tolerance crossing at")
    return touched


def _names(finding: pb.PreflightFinding, name: str) -> bool:
    """Whether ``finding`` names ``name``: the same module or parameter, or one a parameter of the other."""
    for affected in finding.affects:
        if affected == name or _parent(name) == affected or _parent(affected) == name:
            return True
    return False


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""
