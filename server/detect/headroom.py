"""How close each candidate came to its tolerances: the worst value of every metric, per phase.

A faithful port's headroom (worst value over tolerance) is the evidence that
the tolerances fit it; the same figures, taken from pairs run in several
precisions, calibrate the low-precision scale factors
(``benchmarks/calibrate_dtype.py``).  Module inputs are left out: they are
evidence about other code, and the output that produced them is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twinstep.server.compare.comparator import Rows, StepComparison
from twinstep.v1 import twinstep_pb2 as pb

#: Metrics that measure numbers; "shape" and "nonfinite" are exact and have no headroom.
MEASURED = ("rms", "mean", "extrema", "rel_l2", "cosine", "max_abs", "sketch_rel_l2", "sketch_cosine")


@dataclass
class _Worst:
    value: float
    tolerance: float
    step: int
    module: str
    dtype: str


class HeadroomTracker:
    """(candidate, phase, metric) -> the largest finite value seen, with where it was."""

    def __init__(self) -> None:
        self._worst: dict[tuple[str, str, str], _Worst] = {}

    def add(self, comparison: StepComparison) -> None:
        """Fold one compared step in."""
        if not comparison.rows or not comparison.values:
            return
        if isinstance(comparison.rows, Rows):
            self._add_planned(comparison, comparison.rows)
            return
        phases = np.array([row.phase for row in comparison.rows])
        for phase in np.unique(phases).tolist():
            if phase == "input":
                continue
            rows = np.flatnonzero(phases == phase)
            for metric in MEASURED:
                self._fold(comparison, phase, metric, rows)

    def _fold(self, comparison: StepComparison, phase: str, metric: str, rows: np.ndarray) -> None:
        """The rule, for one phase's rows and one metric: the first largest finite value, if above the known one."""
        values = comparison.values[metric][rows]
        finite = np.isfinite(values)
        if not finite.any():
            return
        k = int(rows[np.argmax(np.where(finite, values, -1.0))])
        value = float(comparison.values[metric][k])
        key = (comparison.candidate_run, phase, metric)
        known = self._worst.get(key)
        if value > 0 and (known is None or value > known.value):
            tolerance = comparison.tolerance.get(metric)
            name, dtype = _name_and_dtype(comparison, k)
            self._worst[key] = _Worst(
                value=value,
                tolerance=float(tolerance[k]) if tolerance is not None else float("inf"),
                step=comparison.step,
                module=name,
                dtype=dtype,
            )

    def _add_planned(self, comparison: StepComparison, rows: Rows) -> None:
        """:meth:`add` over the whole step at once: per phase (rows grouped once per join plan) the largest
        finite value of every metric; the per-metric rule runs only where that beats the known worst."""
        groups = rows.plan.derived.get("headroom")
        if groups is None:
            groups = rows.plan.derived["headroom"] = _phase_groups(rows.plan.phases)
        names, order, starts = groups
        if not names:
            return
        values = np.stack([comparison.values[m] for m in MEASURED])[:, order]
        finite = np.isfinite(values)
        largest = np.maximum.reduceat(np.where(finite, values, -1.0), starts, axis=1)
        known = np.array([[w.value if (w := self._worst.get((comparison.candidate_run, phase, metric))) else 0.0
                           for phase in names] for metric in MEASURED]) if self._worst else np.zeros_like(largest)
        # A phase's worst changes where its largest finite value is above the known one (known ones are > 0);
        # where every finite value is <= -1 the rule may pick a non-finite one: leave that to the rule too.
        ends = np.append(starts[1:], len(order))
        # Phase by phase, metric by metric, as add folds them: new keys are listed (to_proto) in that order.
        for g, m in zip(*np.nonzero(((largest > known) | (largest <= -1.0)).T)):
            self._fold(comparison, names[g], MEASURED[m], order[starts[g]:ends[g]])
    def to_proto(self, run: str) -> list[pb.Headroom]:
        return [
            pb.Headroom(candidate_run=r, phase=phase, metric=metric, value=w.value, tolerance=w.tolerance,
                        step=w.step, module=w.module, dtype=w.dtype)
            for (r, phase, metric), w in self._worst.items()
            if r == run
        ]


def _name_and_dtype(comparison: StepComparison, k: int) -> tuple[str, str]:
    rows = comparison.rows
    if isinstance(rows, Rows):  # without making the row
        static = rows.plan.static_rows[k]
        return static[1], static[7]
    return rows[k].name, rows[k].dtype


def _phase_groups(phases: list[str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(phase names in sorted order without "input", row indices grouped by phase (ascending within
    each), start of each group in them)."""
    names = sorted(set(phases) - {"input"})
    column = np.array(phases, dtype=object)
    groups = [np.flatnonzero(column == phase) for phase in names]
    order = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]]).astype(np.int64)
    return names, order, starts
