"""Noise bands from a reference rerun of the baseline.

A session may include a *reference* run: the baseline trained again with
determinism off, or in another precision.  Its differences from the baseline
are the baseline's own run-to-run noise.  Each record's band is the largest
difference seen so far per metric; a candidate's tolerance becomes a multiple
of that band, never below a floor (a deterministic rerun gives a band of 0).
This is the seeds' long-run prescription applied per module: the port passes
where it stays within the baseline's own band.
"""

from __future__ import annotations

import numpy as np

from twinstep.server.compare.comparator import Row, StepComparison

#: Key of a record across steps: (phase, baseline name, call index, slot).
Key = tuple[str, str, int, int]


class NoiseBands:
    def __init__(self, multiple: float, floor_fraction: float) -> None:
        self.multiple = multiple
        self.floor_fraction = floor_fraction
        self._bands: dict[Key, dict[str, float]] = {}
        self.steps: set[int] = set()

    def add(self, comparison: StepComparison) -> None:
        """Record a reference run's metric values for one step."""
        self.steps.add(comparison.step)
        for k, row in enumerate(comparison.rows):
            band = self._bands.setdefault(row_key(row), {})
            for metric, values in comparison.values.items():
                value = float(values[k])
                if np.isfinite(value) and value > band.get(metric, 0.0):
                    band[metric] = value

    def band(self, key: Key) -> dict[str, float] | None:
        return self._bands.get(key)

    def tolerance(self, key: Key, metric: str, default: float) -> float:
        """multiple x band, at least floor_fraction x the default; the default where no band exists."""
        band = self._bands.get(key)
        if band is None:
            return default
        return max(self.multiple * band.get(metric, 0.0), self.floor_fraction * default)


def row_key(row: Row) -> Key:
    return (row.phase, row.name, row.call_index, row.slot)
