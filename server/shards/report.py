"""A session's report on a sharded server: the shards' reports of their ranks, made one.

The session's first divergence, its stage, culprit and tree come from the shard
whose ranks hold it, and only once it is final over every shard (view.py): a
shard's own earlier declaration is not the session's until the others have
passed its step, and the report then says the session is still running rather
than name a divergence another shard may still precede.  Runs are summed over
the ranks each shard holds; lists (errors, unmatched names, findings) are the
union; steps compared on every rank are the fewest any comparing shard has.
"""

from __future__ import annotations

from typing import Iterable

from twinstep.server.report import explained
from twinstep.server.runs.membership import add_cost
from twinstep.server.shards.view import GlobalFirst, SessionView
from twinstep.v1 import twinstep_pb2 as pb

_STATUS_ORDER = ("running", "waiting", "incomplete", "aligned")


def merge_runs(per_shard: Iterable[Iterable[pb.RunStatus]]) -> list[pb.RunStatus]:
    """One RunStatus per run over the shards' (each holds some of its ranks)."""
    merged: dict[str, pb.RunStatus] = {}
    for runs in per_shard:
        for run in runs:
            seen = merged.get(run.name)
            if seen is None:
                merged[run.name] = out = pb.RunStatus()
                out.CopyFrom(run)
                continue
            seen.ranks = max(seen.ranks, run.ranks)
            seen.last_step = max(seen.last_step, run.last_step)
            if run.first_step >= 0:
                seen.first_step = run.first_step if seen.first_step < 0 else min(seen.first_step, run.first_step)
            seen.state = _run_state(seen.state, run.state)
            seen.dropped += run.dropped
            seen.records_received += run.records_received
            seen.steps_resent += run.steps_resent
            add_cost(seen.capture_cost, run.capture_cost)
            for reason, count in run.dropped_by_reason.items():
                seen.dropped_by_reason[reason] = seen.dropped_by_reason.get(reason, 0) + count
            seen.health.extend(run.health)
            for warning in run.warnings:
                if warning not in seen.warnings:
                    seen.warnings.append(warning)
            if not seen.environment and run.environment:
                seen.environment.update(run.environment)
    for run in merged.values():
        ordered = sorted(run.health, key=lambda health: health.rank)
        del run.health[:]
        run.health.extend(ordered)
    return list(merged.values())


def _run_state(a: str, b: str) -> str:
    """A run's state from two shares of its ranks (the order RunState.state applies to ranks)."""
    states = {a, b}
    if "streaming" in states:
        return "streaming"
    for final in ("halted", "lost"):
        if final in states:
            return final
    return "finished"


def _union(target, *sources) -> None:
    seen = {item.SerializeToString() if hasattr(item, "SerializeToString") else item for item in target}
    for source in sources:
        for item in source:
            key = item.SerializeToString() if hasattr(item, "SerializeToString") else item
            if key not in seen:
                seen.add(key)
                target.append(item)


def _status(statuses: list[str], diverged: bool) -> str:
    if diverged:
        return "diverged"
    # A shard's own "diverged" is not final for the session yet: it is still running.
    statuses = ["running" if status == "diverged" else status for status in statuses]
    return next((status for status in _STATUS_ORDER if status in statuses), statuses[0] if statuses else "running")


def _clear_first(message) -> None:
    for name in ("first_divergence", "stage", "culprit"):
        message.ClearField(name)
    del message.tree[:]


def merge_reports(view: SessionView, reports: dict[int, pb.Report], errors: list[str]) -> pb.Report:
    """The session's report from each shard's (by index); ``errors``: the coordinator's own."""
    firsts = {name: found for name, found in view.firsts().items() if found.final}
    primary: GlobalFirst | None = min(firsts.values(), key=lambda f: tuple(f.divergence["key"]), default=None)
    home = view.home() if view.home() in reports else min(reports)
    base_index = primary.shard if primary is not None and primary.shard in reports else home
    out = pb.Report()
    out.CopyFrom(reports[base_index])
    others = [report for index, report in sorted(reports.items())]
    if primary is None:
        _clear_first(out)
    out.halted = any(report.halted for report in others)
    del out.runs[:]
    out.runs.extend(merge_runs(report.runs for report in others))
    out.steps_compared = _fewest(view, reports, None)
    for field in ("unmatched_baseline", "unmatched_candidate", "status_reasons", "errors", "tensor_steps",
                  "operations", "layout_differences", "replica_mismatches"):
        target = getattr(out, field)
        del target[:]
        _union(target, *(getattr(report, field) for report in others))
    _union(out.errors, errors)
    # What rank 0 alone has: the runs' set-ups (a run's set-up is its lowest rank's), the long-run loss and
    # gradient norm, the named records, batch sync, the zooms asked.
    for field in ("long_run", "records", "zooms"):
        target = getattr(out, field)
        del target[:]
        target.extend(getattr(reports[home], field))
    if reports[home].HasField("batch_sync"):
        out.batch_sync.CopyFrom(reports[home].batch_sync)
    else:
        out.ClearField("batch_sync")
    _merge_headroom(out, others)
    _merge_coverage(out, view, reports, home)
    _merge_candidates(out, view, reports, firsts)
    entry = next((c for c in out.candidates if c.candidate_run == primary.candidate), None) if primary else None
    if entry is not None and out.first_divergence.candidate_run != entry.candidate_run:
        # The base shard's own first belongs to a candidate whose divergence is not final yet: the session's is
        # the primary candidate's, with its words.
        out.first_divergence.CopyFrom(entry.first_divergence)
        out.stage, out.culprit = entry.stage, entry.culprit
        del out.tree[:]
        out.tree.extend(entry.tree)
    _explain(out, reports[home])
    statuses = [report.status for report in others]
    out.status = _status(statuses, diverged=bool(firsts))
    if not firsts and any(status == "diverged" for status in statuses):
        waiting = {shard for found in view.firsts().values() for shard in found.waiting_for}
        out.status_reasons.append(
            "a shard found a divergence; it is the session's first once shard(s) "
            f"{', '.join(map(str, sorted(waiting)))} have compared up to its step")
    return out


def _fewest(view: SessionView, reports: dict[int, pb.Report], candidate: str | None) -> int:
    """Steps compared on every rank: the fewest any comparing shard's report has (each counts its own ranks)."""
    names = [candidate] if candidate else view.candidates()
    shards = set().union(*(view.participants(name) for name in names)) if names else set()
    if not shards or not shards <= set(reports):
        return 0
    if candidate is None:
        return min(reports[s].steps_compared for s in shards)
    return min((c.steps_compared for s in shards for c in reports[s].candidates if c.candidate_run == candidate),
               default=0)


def _merge_headroom(out: pb.Report, reports: list[pb.Report]) -> None:
    """Per candidate, phase and metric: the closest approach to tolerance over every shard."""
    best: dict[tuple[str, str, str], pb.Headroom] = {}
    for report in reports:
        for row in report.headroom:
            key = (row.candidate_run, row.phase, row.metric)
            ratio = row.value / row.tolerance if row.tolerance else 0.0
            seen = best.get(key)
            if seen is None or ratio > (seen.value / seen.tolerance if seen.tolerance else 0.0):
                best[key] = row
    del out.headroom[:]
    out.headroom.extend(best.values())


def _explain(out: pb.Report, home: pb.Report) -> None:
    """Rank 0's set-up findings, joined afresh to the session's divergences (twinstep.server.report.explained)."""
    del out.preflight[:]
    out.preflight.extend(home.preflight)
    for finding in out.preflight:
        finding.explained, finding.explanation = False, ""
    divergences = {c.candidate_run: c.first_divergence for c in out.candidates if c.HasField("first_divergence")}
    for divergence in divergences.values():
        del divergence.explained_by[:]
    explained.join(list(out.preflight), divergences)
    if out.HasField("first_divergence"):
        del out.first_divergence.explained_by[:]
        own = divergences.get(out.first_divergence.candidate_run)
        if own is not None:
            out.first_divergence.explained_by.extend(own.explained_by)


def _merge_coverage(out: pb.Report, view: SessionView, reports: dict[int, pb.Report], home: int) -> None:
    """Per candidate: the coverage of the comparing shard that compared the fewest steps (its summary is then
    true of the session), rank 0's compared steps, and every shard's gaps (each lists its own ranks')."""
    merged = []
    for candidate in view.candidates():
        shards = [s for s in sorted(view.participants(candidate)) if s in reports]
        rows = [(s, row) for s in shards for row in reports[s].coverage if row.candidate_run == candidate]
        if not rows:
            continue
        _, least = min(rows, key=lambda item: item[1].steps_compared)
        row = pb.Coverage()
        row.CopyFrom(least)
        rank_zero = next((other for s, other in rows if s == home), None)
        if rank_zero is not None:
            del row.compared[:]
            row.compared.extend(rank_zero.compared)
        _union(row.gaps, *(other.gaps for _, other in rows))
        row.gaps_unlisted = sum(other.gaps_unlisted for _, other in rows)
        _union(row.declared, *(other.declared for _, other in rows))
        merged.append(row)
    del out.coverage[:]
    out.coverage.extend(merged)


def _merge_candidates(out: pb.Report, view: SessionView, reports: dict[int, pb.Report],
                      firsts: dict[str, GlobalFirst]) -> None:
    merged = []
    for candidate in view.candidates():
        found = firsts.get(candidate)
        shards = [s for s in sorted(view.participants(candidate)) if s in reports] or sorted(reports)
        source = found.shard if found is not None and found.shard in reports else shards[0]
        row = next((c for c in reports[source].candidates if c.candidate_run == candidate), None)
        if row is None:
            continue
        entry = pb.CandidateReport()
        entry.CopyFrom(row)
        statuses = [c.status for s in shards for c in reports[s].candidates if c.candidate_run == candidate]
        if found is None:
            _clear_first(entry)
        entry.status = _status(statuses, diverged=found is not None)
        entry.halted = any(c.halted for s in shards for c in reports[s].candidates if c.candidate_run == candidate)
        entry.steps_compared = _fewest(view, reports, candidate)
        merged.append(entry)
    del out.candidates[:]
    out.candidates.extend(merged)
