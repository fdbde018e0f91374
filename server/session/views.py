"""What others read of a session's core: copies, built under the coordinator's lock and read without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from twinstep.server.report.snapshot import CandidateSnapshot, SessionSnapshot
from twinstep.server.runs.membership import ENDED
from twinstep.server.session import verdict
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.session.core import SessionCore


@dataclass(frozen=True)
class MetricsView:
    """What /metrics says of one session (twinstep.server.alert.prometheus)."""

    name: str
    status: str
    halted: bool
    steps_compared: int
    held_bytes: int
    runs: tuple[pb.RunStatus, ...]
    steps_received: dict[str, int]
    """Per run: steps delivered, over its ranks."""
    diverged: frozenset[str]
    preflight_warnings: dict[str, int]
    steps_compared_by: dict[str, int]
    """Per candidate and reference."""


@dataclass(frozen=True)
class BaselineRank:
    """One rank of the baseline as a candidate waiting for its batches sees it."""

    run: str | None
    """The baseline's name (None: none joined yet)."""
    state: str | None
    """Its stream's state (None: this rank never joined)."""
    ended: bool
    """Ended for good (not within a reconnect grace)."""
    last_step: int


def run_status(core: "SessionCore") -> list[pb.RunStatus]:
    return core.members.status_rows(core.pipeline.dropped_by_reason)


def progress(core: "SessionCore") -> pb.Progress:
    """What watchers see of the runs now: their status, steps compared, the latest error per stage."""
    return pb.Progress(runs=run_status(core), steps_compared=core.pipeline.steps_compared(),
                       stages=core.pipeline.stage_errors.to_proto())


def snapshot(core: "SessionCore", long_run: bool, batch_sync: pb.BatchSync | None,
             final: bool = False) -> SessionSnapshot:
    """Everything a report says (see Session.snapshot; ``final``: no run can join any more)."""
    pipeline = core.pipeline
    status, reasons = verdict.status_and_reasons(core, final)
    coverage = {run: pipeline.coverage_of(run) for run in core.candidates}
    reference = next(iter(core.references), None)
    summaries = []
    for run in core.candidates if long_run else ():
        summary = pipeline.long_run.summary(run, reference, core.config.comparison.noise_multiple)
        if summary is not None:
            summary.coverage = coverage[run].summary
            summaries.append(summary)
    return SessionSnapshot(
        name=core.name,
        status=status,
        status_reasons=tuple(reasons),
        halted=core.halted,
        runs=tuple(run_status(core)),
        steps_compared=pipeline.steps_compared(),
        first=pipeline.tracker.first(),
        last_comparison=pipeline.last_comparison,
        unmatched_baseline=tuple(map(str, pipeline.unmatched_baseline)),
        unmatched_candidate=tuple(map(str, pipeline.unmatched_candidate)),
        errors=tuple(core.errors),
        proposed_mapping=next((core.mappings.proposals[run] for run in core.candidates
                               if core.mappings.proposals.get(run)), None),
        coverage=tuple(coverage.values()),
        long_run=tuple(summaries),
        headroom=tuple(h for run in core.candidates for h in pipeline.headroom.to_proto(run)),
        records=tuple(r for run in core.candidates for r in pipeline.named_records.to_proto(run)),
        batch_sync=batch_sync,
        zooms=tuple(core.zooms.to_proto()),
        tensor_steps=tuple(pipeline.tensor_steps.to_proto()),
        operations=tuple(core.operations.to_proto()),
        preflight=tuple(core.preflight.to_proto(core.candidates)),
        candidates=tuple(_candidate(core, run, coverage[run].summary, final) for run in core.candidates),
        layout_mode=pipeline.layout_mode or "",
        layout_summary=pipeline.layout_words(),
        layout_differences=tuple(pipeline.layouts.differences()),
        replica_mismatches=tuple(pipeline.layouts.replica_mismatches()),
        merged_from=_merged_from(core),
    )


def _merged_from(core: "SessionCore") -> dict[str, str]:
    """Per candidate with a declared divergence: what its and the baseline's records were merged from."""
    out = {}
    for run, found in core.pipeline.tracker.declared.items():
        text = core.pipeline.merged_from(run, found.row)
        if text:
            out[run] = text
    return out


def _candidate(core: "SessionCore", candidate: str, coverage: str, final: bool = False) -> CandidateSnapshot:
    """One candidate's section of the report."""
    pipeline = core.pipeline
    status, reasons = verdict.of_candidate(core, candidate, final)
    run = core.runs[candidate]
    world = min(run.world_size, core.runs[core.baseline].world_size) if core.baseline in core.runs else 1
    world = pipeline.compared_count(world)  # 1 when each run's ranks are merged; a shard's ranks on a shard
    return CandidateSnapshot(
        run=candidate, framework=run.framework, status=status, status_reasons=tuple(reasons),
        halted=core.halted or candidate in core.halts.runs_halted,
        steps_compared=pipeline.tracker.steps_compared_on_every_rank(candidate, world),
        first=pipeline.tracker.declared.get(candidate), last_comparison=pipeline.tracker.last.get(candidate),
        coverage=coverage)


def metrics(core: "SessionCore", held_bytes: int) -> MetricsView:
    tracker = core.pipeline.tracker
    return MetricsView(
        name=core.name, status=verdict.status_and_reasons(core)[0], halted=core.halted,
        steps_compared=core.pipeline.steps_compared(), held_bytes=held_bytes, runs=tuple(run_status(core)),
        steps_received={run.name: sum(core.coverage.rank(run.name, rank).delivered.count() for rank in run.ranks)
                        for run in core.runs.values()},
        diverged=frozenset(tracker.declared),
        preflight_warnings={run: sum(f.severity == "warning" for f in findings)
                            for run, findings in core.preflight.findings.items()},
        steps_compared_by={name: tracker.steps_compared_by(name) for name in (*core.candidates, *core.references)},
    )


def baseline_rank(core: "SessionCore", rank: int) -> BaselineRank:
    baseline = core.runs.get(core.baseline or "")
    state = baseline.ranks.get(rank) if baseline is not None else None
    return BaselineRank(run=core.baseline, state=None if state is None else state.state,
                        ended=state is not None and state.state in ENDED and not state.awaiting_return,
                        last_step=state.last_step if state is not None else -1)
