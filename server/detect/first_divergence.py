"""Declare the first divergence only when no earlier one can still appear.

Order: earliest step; within a step forward, loss, backward, grad, param,
and each named record where the baseline recorded it (before the forward,
after it, or after the backward: twinstep.phases.record_position);
within a phase the baseline's record order (outputs in the order they were
produced, gradients in the order backward produced them); then rank.  A
divergence at step s is declared once, for every rank, both runs have
delivered step s or ended, so a slow rank cannot hide an earlier divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twinstep.phases import STEP_ORDER, record_position, step_position
import numpy as np

from twinstep.server.compare.comparator import Row, Rows, StepComparison
from twinstep.server.detect.gaps import describe as describe_gaps
from twinstep.server.detect.stage import describe
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

    @property
    def after_gap(self) -> bool:
        return bool(self.gaps_before) or self.gaps_unlisted > 0

    def to_proto(self) -> pb.Divergence:
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

    def __init__(self) -> None:
        self._best: dict[str, Candidate] = {}
        self.declared: dict[str, Candidate] = {}
        self._compared: dict[str, dict[int, set[int]]] = {}
        # run -> step -> (largest value/tolerance among parameters after the update, its name)
        self._param_headroom: dict[str, dict[int, tuple[float, str]]] = {}

    def add(self, comparison: StepComparison) -> None:
        self._compared.setdefault(comparison.candidate_run, {}).setdefault(comparison.step, set()).add(comparison.rank)
        closest = _closest_param(comparison)
        if closest is not None:
            steps = self._param_headroom.setdefault(comparison.candidate_run, {})
            steps[comparison.step] = max(closest, steps.get(comparison.step, (0.0, "")))
        row = comparison.first
        if row is None or comparison.candidate_run in self.declared:
            return
        position = comparison.rows.index(row)
        key = (comparison.step, _place_in_step(comparison, row.phase, position), position, comparison.rank)
        best = self._best.get(comparison.candidate_run)
        if best is None or key < best.key:
            previous = self._param_headroom.get(comparison.candidate_run, {}).get(comparison.step - 1)
            self._best[comparison.candidate_run] = Candidate(key, row, comparison, previous)

    def declare(self, frontier: dict[str, float]) -> list[Candidate]:
        """Candidates whose divergence step is at or below their run's frontier; each once."""
        newly = []
        for run, best in list(self._best.items()):
            if run not in self.declared and best.key[0] <= frontier.get(run, -1):
                self.declared[run] = best
                newly.append(best)
        return newly

    def first(self) -> Candidate | None:
        if not self.declared:
            return None
        return min(self.declared.values(), key=lambda c: c.key)

    def steps_compared_by(self, run: str) -> int:
        """Steps of one candidate compared on at least one rank."""
        return len(self._compared.get(run, {}))

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
