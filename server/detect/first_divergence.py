"""Declare the first divergence only when no earlier one can still appear.

Order: earliest step; within a step forward, loss, backward, grad, param,
and each named record where the baseline recorded it (before the forward,
after it, or after the backward: twinstep.wire.phases.record_position);
within a phase the baseline's record order (outputs in the order they were
produced, gradients in the order backward produced them); then rank.  A
divergence at step s is declared once, for every rank, both runs have
delivered step s or ended, so a slow rank cannot hide an earlier divergence.

A difference too small for any tolerance is traced back to where it began
(twinstep.server.detect.origin): when its evidence is clear, the origin is the
first divergence, earlier than any tolerance crossing (which it then carries),
even when that crossing was already declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twinstep.wire.phases import STEP_ORDER, record_position, step_position
import numpy as np

from twinstep.server.compare.comparator import Row, Rows, StepComparison
from twinstep.server.detect import path
from twinstep.server.detect.gaps import describe as describe_gaps
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.detect.origin import Origin, OriginTracer
from twinstep.server.detect.stage import describe, describe_origin
from twinstep.v1 import twinstep_pb2 as pb

@dataclass
class Candidate:
    key: tuple[int, int, int, int]
    row: Row
    comparison: StepComparison
    previous_params: tuple[float, str] | None = None
    """Closest approach to tolerance of the parameters after the step before (ratio, name)."""
    gaps_before: list[pb.Gap] = field(default_factory=list)
    """Uncompared, undeclared steps (or phases) before it, found when it was declared."""
    gaps_unlisted: int = 0
    origin: Origin | None = None
    """Set when traced back to where it began (no tolerance crossed there)."""
    crossed: "Candidate | None" = None
    """For an origin: where the error first crossed a tolerance, once it did."""

    @property
    def after_gap(self) -> bool:
        return bool(self.gaps_before) or self.gaps_unlisted > 0

    def to_proto(self) -> pb.Divergence:
        origin = self.origin
        if origin is None:
            return self._plain_proto()
        divergence = self._plain_proto()
        divergence.stage = describe_origin(origin)
        divergence.origin.CopyFrom(pb.OriginEvidence(
            evidence=origin.evidence, rule=origin.rule, ratio=origin.ratio, evidence_step=origin.evidence_step,
            involved=origin.involved, involved_total=origin.involved_total))
        crossed = self.crossed
        if crossed is not None:
            c = crossed.row
            divergence.crossed.CopyFrom(pb.ToleranceCrossing(
                step=crossed.comparison.step, rank=crossed.comparison.rank, phase=c.phase, module=c.name,
                metric=c.metric, value=c.value, tolerance=c.tolerance))
        words = "origin: creates it" if origin.row.phase == "forward" else "origin"
        divergence.path.extend(path.build(self.row, self.comparison, crossed.row if crossed else None,
                                          crossed.comparison if crossed else None, words))
        return divergence

    def _plain_proto(self) -> pb.Divergence:
        row, comparison = self.row, self.comparison
        return pb.Divergence(
            step=comparison.step,
            rank=comparison.rank,
            phase=row.phase,
            module=row.name,
            candidate_module=row.candidate_name,
            metric=row.metric,
            value=row.value,
            tolerance=row.tolerance,
            candidate_run=comparison.candidate_run,
            stage=describe(row, comparison, self.previous_params),
            gaps_before=self.gaps_before,
            after_gap=self.after_gap,
            gaps_summary=describe_gaps(self.gaps_before, self.gaps_unlisted) if self.after_gap else "",
        )


class FirstDivergenceTracker:
    """Per candidate run: the earliest divergence seen, and whether it is declared."""

    def __init__(self, trace_origins: bool = True, tolerances: ToleranceConfig | None = None) -> None:
        self._best: dict[str, Candidate] = {}
        self.declared: dict[str, Candidate] = {}
        self._compared: dict[str, dict[int, set[int]]] = {}
        # run -> step -> (largest value/tolerance among parameters after the update, its name)
        self._param_headroom: dict[str, dict[int, tuple[float, str]]] = {}
        self.last: dict[str, StepComparison] = {}
        """Per candidate run: its latest comparison (its report section's tree when it has not diverged)."""
        self.origins = OriginTracer(tolerances) if trace_origins else None
        """Traces sub-tolerance differences back to their origin (server config trace_origins; docs/origin.md)."""
        self._redeclared: list[Candidate] = []

    def add(self, comparison: StepComparison) -> None:
        self._compared.setdefault(comparison.candidate_run, {}).setdefault(comparison.step, set()).add(comparison.rank)
        self.last[comparison.candidate_run] = comparison
        closest = _closest_param(comparison)
        if closest is not None:
            steps = self._param_headroom.setdefault(comparison.candidate_run, {})
            steps[comparison.step] = max(closest, steps.get(comparison.step, (0.0, "")))
        run = comparison.candidate_run
        row = comparison.first
        if row is not None:
            position = comparison.rows.index(row)
            key = (comparison.step, _place_in_step(comparison, row.phase, position), position, comparison.rank)
            previous = self._param_headroom.get(run, {}).get(comparison.step - 1)
            found = self.declared.get(run) or self._best.get(run)
            if found is not None and found.origin is not None:
                if found.crossed is None or key < found.crossed.key:
                    found.crossed = Candidate(key, row, comparison, previous)
            elif run not in self.declared and (found is None or key < found.key):
                self._best[run] = Candidate(key, row, comparison, previous)
        origin = self.origins.observe(comparison) if self.origins is not None else None
        if origin is not None:
            self._traced_back(run, origin)

    def _traced_back(self, run: str, origin: Origin) -> None:
        """An origin before the earliest crossing (or with none yet) becomes the run's first divergence."""
        at = origin.comparison
        position = at.rows.index(origin.row)
        key = (at.step, _place_in_step(at, origin.row.phase, position), position, at.rank)
        current = self.declared.get(run) or self._best.get(run)
        if current is not None:
            # Within one step and phase only a forward origin's position compares (same records); a parameter
            # origin rebuilt from the history must be strictly earlier than the crossing to replace it.
            earlier = key < current.key if origin.row.phase == "forward" else key[:2] < current.key[:2]
            if not earlier:
                return
        # An origin replacing another (a parameter update found behind a forward origin) keeps its crossing.
        crossed = current.crossed if current is not None and current.origin is not None else current
        candidate = Candidate(key, origin.row, at, origin=origin, crossed=crossed)
        if run in self.declared:
            self.declared[run] = candidate
            self._redeclared.append(candidate)
        else:
            self._best[run] = candidate

    def declare(self, frontier: dict[str, float]) -> list[Candidate]:
        """Candidates whose divergence step is at or below their run's frontier; each once."""
        newly, self._redeclared = self._redeclared, []
        for run, best in list(self._best.items()):
            if run not in self.declared and best.key[0] <= frontier.get(run, -1):
                self.declared[run] = best
                newly.append(best)
        return newly

    def pending(self) -> dict[str, Candidate]:
        """Per candidate, its earliest divergence found so far, declared or not (a shard's coordinator waits
        for every shard's frontier to pass it)."""
        return {run: self.declared.get(run) or found for run, found in self._best.items()}

    def first(self) -> Candidate | None:
        if not self.declared:
            return None
        return min(self.declared.values(), key=lambda c: c.key)

    def steps_compared_by(self, run: str) -> int:
        """Steps of one candidate compared on at least one rank."""
        return len(self._compared.get(run, {}))

    def steps_compared_on_every_rank(self, run: str, world_size: int) -> int:
        """Steps of one candidate compared on every one of ``world_size`` ranks."""
        return sum(1 for ranks in self._compared.get(run, {}).values() if len(ranks) >= world_size)

    def steps_compared(self, world_size: int) -> int:
        """Steps compared on every rank, for the candidate that got furthest."""
        return max(
            (sum(1 for ranks in steps.values() if len(ranks) >= world_size) for steps in self._compared.values()),
            default=0,
        )


def _place_in_step(comparison: StepComparison, phase: str, position: int) -> float:
    """Where a record comes in its step: its phase's place, or for a named record the place it was recorded
    at, after the step phase of the baseline's records just before it (they go out in step order)."""
    if phase != "record":
        return step_position(phase)
    rows = comparison.rows
    before = rows.plan.phases[:position] if isinstance(rows, Rows) else [r.phase for r in rows[:position]]
    after = next((p for p in reversed(before) if p in STEP_ORDER), None)
    return record_position(after)


def _closest_param(comparison: StepComparison) -> tuple[float, str] | None:
    """The largest (value / tolerance, name) among parameter rows with a tolerance, or None without any."""
    rows = comparison.rows
    if isinstance(rows, Rows):
        plan = rows.plan
        params = plan.derived.get("param_rows")
        if params is None:
            params = plan.derived["param_rows"] = np.flatnonzero(np.array([p == "param" for p in plan.phases], bool))
        tolerance = rows.tolerance[params]
        has = tolerance > 0
        if not has.any():
            return None
        params = params[has]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = rows.value[params] / tolerance[has]
        if not np.isnan(ratio).any():  # (NaN orders as Python's max sees it: below)
            best = ratio.max()
            names = [plan.static_rows[k][1] for k in params[ratio == best].tolist()]
            return (best.item(), max(names))
    candidates = [(r.value / r.tolerance, r.name) for r in rows if r.phase == "param" and r.tolerance > 0]
    return max(candidates) if candidates else None
