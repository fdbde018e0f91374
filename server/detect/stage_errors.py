"""The latest error per stage: how close each phase of the newest compared step came to its tolerance.

A live view (``twinstep watch``, the dashboard) shows per candidate run one
number per phase (forward, loss, backward, grad, param): the worst record's
error over tolerance in the latest compared step, the largest over ranks.
Module inputs are left out, as in the headroom (evidence about other code).
One vectorised pass per compared step; per-phase row groups are made once
per join plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinstep.wire import phases
from twinstep.server.compare.comparator import Rows, StepComparison
from twinstep.server.compare.tolerance import METRICS
from twinstep.v1 import twinstep_pb2 as pb

_ORDER = {phase: i for i, phase in enumerate(phases.STEP_ORDER)}


@dataclass
class _Worst:
    ratio: float
    rank: int
    module: str
    metric: str
    value: float
    tolerance: float


class StageErrors:
    """candidate run -> (latest compared step, phase -> its worst record)."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[int, dict[str, _Worst]]] = {}

    def add(self, comparison: StepComparison) -> None:
        """Fold one compared step in: a newer step replaces the run's figures, the same step on
        another rank keeps the larger per phase, an older one is ignored."""
        run, step = comparison.candidate_run, comparison.step
        known = self._latest.get(run)
        if known is not None and step < known[0]:
            return
        if known is None or step > known[0]:
            known = self._latest[run] = (step, {})
        worst = known[1]
        for phase, found in _worst_per_phase(comparison):
            if phase not in worst or found.ratio > worst[phase].ratio:
                worst[phase] = found

    def to_proto(self) -> list[pb.StageError]:
        out = []
        for run, (step, worst) in self._latest.items():
            for phase in sorted(worst, key=lambda p: _ORDER.get(p, len(_ORDER))):
                w = worst[phase]
                out.append(pb.StageError(run=run, step=step, phase=phase, ratio=w.ratio, module=w.module,
                                         metric=w.metric, value=w.value, tolerance=w.tolerance, rank=w.rank))
        return out


def _ratios(value: np.ndarray, tolerance: np.ndarray, divergent: np.ndarray) -> np.ndarray:
    """value / tolerance; where that is not a finite number, inf if the record diverged, else 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(tolerance > 0, value / tolerance, np.where(value > 0, np.inf, 0.0))
    bad = ~np.isfinite(ratio)
    return np.where(bad, np.where(divergent, np.inf, 0.0), ratio)


def _worst_per_phase(comparison: StepComparison) -> list[tuple[str, _Worst]]:
    rows = comparison.rows
    if not len(rows):
        return []
    if isinstance(rows, Rows):
        groups = rows.plan.derived.get("stage_errors")
        if groups is None:
            column = np.array(rows.plan.phases, dtype=object)
            groups = rows.plan.derived["stage_errors"] = [
                (phase, np.flatnonzero(column == phase)) for phase in sorted(set(rows.plan.phases) - {"input"})]
        ratio = _ratios(rows.value, rows.tolerance, rows.divergent)
        out = []
        for phase, index in groups:
            k = int(index[np.argmax(ratio[index])])
            out.append((phase, _Worst(float(ratio[k]), comparison.rank, rows.plan.static_rows[k][1],
                                      METRICS[int(rows.metric[k])], float(rows.value[k]), float(rows.tolerance[k]))))
        return out
    best: dict[str, _Worst] = {}
    for row in rows:  # rows built one by one (tests, the in-process path): few
        if row.phase == "input":
            continue
        ratio = float(_ratios(np.array([row.value]), np.array([row.tolerance]), np.array([row.divergent]))[0])
        if row.phase not in best or ratio > best[row.phase].ratio:
            best[row.phase] = _Worst(ratio, comparison.rank, row.name, row.metric, row.value, row.tolerance)
    return list(best.items())


def describe(stage: pb.StageError) -> str:
    """``1.3e+02x rel_l2 of 'layers.1.mlp.act'``: for a line of text."""
    ratio = "inf" if math.isinf(stage.ratio) else f"{stage.ratio:.3g}"
    return f"{ratio}x {stage.metric} of {stage.module or '(model)'!r}"
