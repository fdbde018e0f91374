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

from twinstep.server.compare.comparator import StepComparison
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
        phases = np.array([row.phase for row in comparison.rows])
        for phase in np.unique(phases).tolist():
            if phase == "input":
                continue
            rows = np.flatnonzero(phases == phase)
            for metric in MEASURED:
                values = comparison.values[metric][rows]
                finite = np.isfinite(values)
                if not finite.any():
                    continue
                k = int(rows[np.argmax(np.where(finite, values, -1.0))])
                value = float(comparison.values[metric][k])
                key = (comparison.candidate_run, phase, metric)
                known = self._worst.get(key)
                if value > 0 and (known is None or value > known.value):
                    tolerance = comparison.tolerance.get(metric)
                    self._worst[key] = _Worst(
                        value=value,
                        tolerance=float(tolerance[k]) if tolerance is not None else float("inf"),
                        step=comparison.step,
                        module=comparison.rows[k].name,
                        dtype=comparison.rows[k].dtype,
                    )

    def to_proto(self, run: str) -> list[pb.Headroom]:
        return [
            pb.Headroom(candidate_run=r, phase=phase, metric=metric, value=w.value, tolerance=w.tolerance,
                        step=w.step, module=w.module, dtype=w.dtype)
            for (r, phase, metric), w in self._worst.items()
            if r == run
        ]
