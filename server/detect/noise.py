"""Noise bands from a reference rerun of the baseline.

A session may include a *reference* run: the baseline trained again with
determinism off, or in another precision.  Its differences from the baseline
are the baseline's own run-to-run noise.  Each record's band is the largest
difference seen so far per metric; a candidate's tolerance becomes a multiple
of that band, never below a floor (a deterministic rerun gives a band of 0).
This is porting guides' long-run method applied per module: the port passes
where it stays within the baseline's own band.
"""

from __future__ import annotations

import numpy as np

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.compare.tolerance import METRICS

#: Key of a record across steps: (phase, baseline name, call index, slot).
Key = tuple[str, str, int, int]


class NoiseBands:
    """Per record key, the largest finite value of each metric seen between baseline and reference.

    Bands are rows of one array (columns in METRICS order), so a step's records
    are folded in and turned into tolerances with numpy, not per record.
    """

    def __init__(self, multiple: float, floor_fraction: float) -> None:
        self.multiple = multiple
        self.floor_fraction = floor_fraction
        self._index: dict[Key, int] = {}
        self._bands = np.zeros((0, len(METRICS)))
        self.steps: set[int] = set()

    def add(self, comparison: StepComparison) -> None:
        """Record a reference run's metric values for one step."""
        self.steps.add(comparison.step)
        if not comparison.rows:
            return
        keys = comparison.keys or [row_key(row) for row in comparison.rows]
        for key in keys:
            if key not in self._index:
                self._index[key] = len(self._index)
        if len(self._index) > len(self._bands):
            grown = np.zeros((max(len(self._index), 2 * len(self._bands)), len(METRICS)))
            grown[: len(self._bands)] = self._bands
            self._bands = grown
        rows = self.rows(keys)
        values = np.zeros((len(keys), len(METRICS)))
        for c, metric in enumerate(METRICS):
            if metric in comparison.values:
                values[:, c] = comparison.values[metric]
        current = self._bands[rows]
        self._bands[rows] = np.where(np.isfinite(values) & (values > current), values, current)

    def rows(self, keys: list[Key]) -> np.ndarray:
        """Band row of each key; -1 where no band exists yet."""
        index = self._index
        return np.fromiter((index.get(key, -1) for key in keys), dtype=np.int64, count=len(keys))

    def banded(self, rows: np.ndarray, defaults: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tolerances for ``rows`` (from :meth:`rows`) given the configured ones, [len(METRICS), n]:
        multiple x band, at least floor_fraction x the default; the default where no band exists.

        Returns (tolerances, bands), both [len(METRICS), n]; bands are -1 where no band exists.
        """
        known = rows >= 0
        bands = np.where(known, self._bands[np.where(known, rows, 0)].T, -1.0)
        with np.errstate(invalid="ignore"):
            tightened = np.maximum(self.multiple * np.maximum(bands, 0.0), self.floor_fraction * defaults)
        return np.where(known, tightened, defaults), bands


def row_key(row: Row) -> Key:
    return (row.phase, row.name, row.call_index, row.slot)
