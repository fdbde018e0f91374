"""Build the Report of a session: verdict, runs, and the module tree around the first divergence."""

from __future__ import annotations

from twinstep.server.compare import automatch
from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect import evidence
from twinstep.server.detect.culprit import explain, growth_factors
from twinstep.server.report import explained
from twinstep.server.report.snapshot import CandidateSnapshot, SessionSnapshot
from twinstep.v1 import twinstep_pb2 as pb

_MAX_ROWS = 60


def build_report(snapshot: SessionSnapshot) -> pb.Report:
    """The Report of a session, from its snapshot (see Session.snapshot).

    The top-level verdict, first divergence, stage, culprit and tree are the session's (its
    earliest divergence among the candidates), as before sessions had several candidates;
    ``candidates`` holds each candidate's own.
    """
    report = pb.Report(
        session=snapshot.name,
        status=snapshot.status,
        status_reasons=snapshot.status_reasons,
        halted=snapshot.halted,
        runs=snapshot.runs,
        steps_compared=snapshot.steps_compared,
        unmatched_baseline=snapshot.unmatched_baseline,
        unmatched_candidate=snapshot.unmatched_candidate,
        errors=snapshot.errors,
        coverage=snapshot.coverage,
        long_run=snapshot.long_run,
        headroom=snapshot.headroom,
        records=snapshot.records,
        zooms=snapshot.zooms,
        tensor_steps=snapshot.tensor_steps,
        preflight=snapshot.preflight,
        operations=snapshot.operations,
        layout_mode=snapshot.layout_mode,
        layout_summary=snapshot.layout_summary,
        layout_differences=snapshot.layout_differences,
        replica_mismatches=snapshot.replica_mismatches,
    )
    if snapshot.batch_sync is not None:
        report.batch_sync.CopyFrom(snapshot.batch_sync)
    first = snapshot.first
    if first is not None:
        row, comparison = first.row, first.comparison
        report.first_divergence.CopyFrom(first.to_proto())
        report.stage = report.first_divergence.stage
        report.culprit = explain(row, comparison, origin=first.origin is not None)
        report.tree.extend(_tree_rows(comparison, row))
    elif snapshot.last_comparison is not None:
        report.tree.extend(_tree_rows(snapshot.last_comparison, None))
    if snapshot.proposed_mapping:
        report.proposed_mapping = automatch.to_yaml(snapshot.proposed_mapping)
    report.candidates.extend(_candidate_section(candidate) for candidate in snapshot.candidates)
    merged_from = snapshot.merged_from or {}
    for section in report.candidates:
        if section.HasField("first_divergence") and section.candidate_run in merged_from:
            section.first_divergence.merged_from = merged_from[section.candidate_run]
    if report.HasField("first_divergence") and report.first_divergence.candidate_run in merged_from:
        report.first_divergence.merged_from = merged_from[report.first_divergence.candidate_run]
    divergences = {c.candidate_run: c.first_divergence for c in report.candidates if c.HasField("first_divergence")}
    explained.join(list(report.preflight), divergences)
    if report.HasField("first_divergence"):
        own = divergences.get(report.first_divergence.candidate_run)
        if own is not None:
            report.first_divergence.explained_by.extend(own.explained_by)
    return report


def _candidate_section(candidate: CandidateSnapshot) -> pb.CandidateReport:
    """One candidate against the baseline: its verdict, first divergence, and the tree around it."""
    section = pb.CandidateReport(
        candidate_run=candidate.run,
        framework=candidate.framework,
        status=candidate.status,
        status_reasons=candidate.status_reasons,
        halted=candidate.halted,
        steps_compared=candidate.steps_compared,
        coverage=candidate.coverage,
        tree_step=-1,
    )
    first = candidate.first
    if first is not None:
        section.first_divergence.CopyFrom(first.to_proto())
        section.stage = section.first_divergence.stage
        section.culprit = explain(first.row, first.comparison, origin=first.origin is not None)
        section.tree.extend(_tree_rows(first.comparison, first.row))
        section.tree_step = first.comparison.step
    elif candidate.last_comparison is not None:
        section.tree.extend(_tree_rows(candidate.last_comparison, None))
        section.tree_step = candidate.last_comparison.step
    return section


def _tree_rows(comparison: StepComparison, first: Row | None) -> list[pb.ModuleRow]:
    """Rows of the phase of interest, narrowed to the neighbourhood of ``first`` when large."""
    phase = first.phase if first else "forward"
    in_phase = [r for r in comparison.rows if r.phase == phase]
    rows = [r for r in in_phase if (r.call_index == 0 and r.slot == 0) or r is first]
    order = _first_positions([r.name for r in in_phase])
    rows.sort(key=lambda r: _tree_key(r.name, order))
    if first is not None and len(rows) > _MAX_ROWS:
        keep = _neighbourhood(first.name)
        rows = [r for r in rows if r is first or _parent(r.name) in keep or r.name in keep]
    growth = growth_factors(comparison)
    shown = {id(r) for r in rows}
    index = {id(r): k for k, r in enumerate(comparison.rows) if id(r) in shown}
    errors = [evidence.error_at(comparison, index[id(r)]) for r in rows]
    inputs = [evidence.input_error(comparison, r) if r.phase == "forward" else None for r in rows]
    return [
        pb.ModuleRow(
            name=r.name,
            type=r.type,
            candidate_name=r.candidate_name,
            metric=r.metric,
            value=r.value,
            tolerance=r.tolerance,
            divergent=r.divergent,
            first=r is first,
            compared=True,
            noise=r.noise,
            growth=growth.get((r.name, r.call_index, r.slot), -1.0),
            error_metric=error.metric,
            error=error.value,
            input_error_metric=given.metric if given is not None else "",
            input_error=given.value if given is not None else -1.0,
        )
        for r, error, given in list(zip(rows, errors, inputs))[: _MAX_ROWS * 2]
    ]


def _first_positions(names: list[str]) -> dict[str, int]:
    """For every module path, the first record at or below it (production order)."""
    first: dict[str, int] = {}
    for position, name in enumerate(names):
        path = name
        while True:
            first.setdefault(path, position)
            if not path:
                break
            path = _parent(path)
    return first


def _tree_key(name: str, first: dict[str, int]) -> tuple[int, ...]:
    """Parents before children, siblings in the order their subtrees first ran."""
    if not name:
        return ()
    parts = name.split(".")
    return tuple(first.get(".".join(parts[: i + 1]), 0) for i in range(len(parts)))


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _neighbourhood(name: str) -> set[str]:
    """The module, its ancestors (whose children are shown too) and the root."""
    keep = {"", name}
    while name:
        name = _parent(name)
        keep.add(name)
    return keep
