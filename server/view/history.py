"""What the dashboard remembers of a session: each module's worst error over tolerance per step, and the
loss and gradient-norm curves of every run against the baseline, bounded however long the runs go.

A run of 100k steps with thousands of modules would take gigabytes at full resolution, so every series
is a :class:`Timeline`: the latest ``steps`` steps keep a column each, older ones are merged into at
most ``steps`` coarser columns of equal width (the width doubles each time they fill), and a merged
column holds the worst record of every row over its steps (curves: sums, so means stay exact).  A
heatmap cell costs 9 bytes (value and tolerance as float32, metric and verdict in one byte), so a
candidate holds at most ``rows x 2 x steps x 9`` bytes; rows past ``max_rows`` are counted, not kept.

Fed by the session under its lock (Session._compare); read by :meth:`SessionHistory.copy`, also under
the lock, and everything else works on the copy.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Callable, Generic, Protocol, TypeVar

import numpy as np

from twinstep.server.compare.comparator import Rows, StepComparison
from twinstep.server.compare.tolerance import METRICS
from twinstep.server.detect.drift import loss_and_grad_norm
from twinstep.server.ingest.step import StepData

logger = logging.getLogger("twinstep.server")

#: ``flags`` of a cell: the metric's index in METRICS in the low bits, DIVERGENT when value > tolerance.
DIVERGENT = 0x80
EMPTY = 0xFF
"""No record of this row in this column."""
_METRIC_BITS = 0x7F
_PLANS_KEPT = 64


class _Column(Protocol):
    first: int
    last: int

    def absorb(self, other: "_Column") -> None: ...


C = TypeVar("C", bound=_Column)


class Timeline(Generic[C]):
    """Columns of one series: the latest ``steps`` steps one each, older steps in equal-width buckets."""

    def __init__(self, steps: int, make: Callable[[int], C]) -> None:
        self.steps = steps
        self._make = make
        self._recent: dict[int, C] = {}
        self._coarse: list[C] = []
        self._coarse_firsts: list[int] = []
        self._width = 1  # columns merged into each coarse bucket
        self._filled = 0  # columns in the last coarse bucket

    def column(self, step: int) -> C:
        """The column that holds ``step`` (a new one for a new step; the bucket of an old step)."""
        found = self._recent.get(step)
        if found is not None:
            return found
        if len(self._recent) < self.steps or step > min(self._recent):
            made = self._recent[step] = self._make(step)
            if len(self._recent) > self.steps:
                oldest = min(self._recent)
                self._retire(self._recent.pop(oldest))
            return made
        return self._bucket_of(step)  # older than every full-resolution column: a late rank's step

    def columns(self) -> list[C]:
        """Every column, oldest first."""
        return self._coarse + [self._recent[step] for step in sorted(self._recent)]

    def _retire(self, column: C) -> None:
        if self._coarse and self._filled < self._width:
            self._coarse[-1].absorb(column)
            self._filled += 1
        else:
            self._coarse.append(column)
            self._coarse_firsts.append(column.first)
            self._filled = 1
        if len(self._coarse) > self.steps:  # halve the buckets: pairs merge, each twice as wide
            pairs = len(self._coarse) % 2 == 0
            last_filled = self._width + self._filled if pairs else self._filled
            merged = []
            for k in range(0, len(self._coarse), 2):
                bucket = self._coarse[k]
                if k + 1 < len(self._coarse):
                    bucket.absorb(self._coarse[k + 1])
                merged.append(bucket)
            self._coarse = merged
            self._coarse_firsts = [bucket.first for bucket in merged]
            self._width *= 2
            self._filled = last_filled  # the last bucket keeps filling up to the new width

    def _bucket_of(self, step: int) -> C:
        if not self._coarse:
            made = self._make(step)
            self._coarse.append(made)
            self._coarse_firsts.append(step)
            self._filled = 1
            return made
        k = max(0, bisect.bisect_right(self._coarse_firsts, step) - 1)
        bucket = self._coarse[k]
        bucket.first, bucket.last = min(bucket.first, step), max(bucket.last, step)
        self._coarse_firsts[k] = bucket.first
        return bucket


# -- the heatmap ------------------------------------------------------------------------------------


class ErrorColumn:
    """Per row, the worst record of one step (or bucket of steps): value, tolerance, metric and verdict."""

    __slots__ = ("first", "flags", "fresh", "last", "tolerance", "value")

    def __init__(self, step: int, rows: int = 0) -> None:
        self.first = self.last = step
        self.value = np.full(rows, np.nan, dtype=np.float32)
        self.tolerance = np.full(rows, np.nan, dtype=np.float32)
        self.flags = np.full(rows, EMPTY, dtype=np.uint8)
        self.fresh = True
        """Nothing put yet: the first step's records are written without comparing (most columns get one)."""

    def grow(self, rows: int) -> None:
        if rows <= len(self.value):
            return
        extra = rows - len(self.value)
        self.value = np.concatenate([self.value, np.full(extra, np.nan, dtype=np.float32)])
        self.tolerance = np.concatenate([self.tolerance, np.full(extra, np.nan, dtype=np.float32)])
        self.flags = np.concatenate([self.flags, np.full(extra, EMPTY, dtype=np.uint8)])

    def put(self, ids: np.ndarray, value: np.ndarray, tolerance: np.ndarray, flags: np.ndarray) -> None:
        """Cells ``ids`` (distinct) take the given records where these are worse than what they hold."""
        if not self.fresh:
            worse = ratios(value, tolerance, flags) > ratios(self.value[ids], self.tolerance[ids], self.flags[ids])
            ids, value, tolerance, flags = ids[worse], value[worse], tolerance[worse], flags[worse]
        self.fresh = False
        self.value[ids] = value
        self.tolerance[ids] = tolerance
        self.flags[ids] = flags

    def absorb(self, other: "ErrorColumn") -> None:
        rows = max(len(self.value), len(other.value))
        self.grow(rows)
        other.grow(rows)
        if not other.fresh:
            self.put(np.arange(rows), other.value, other.tolerance, other.flags)
        self.first, self.last = min(self.first, other.first), max(self.last, other.last)


def ratios(value: np.ndarray, tolerance: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """Error over tolerance per cell: -1 where empty, +inf for a value over a tolerance of 0; a NaN (a
    value of NaN, or 0 over 0) counts as +inf when the record diverged and as 0 when it did not."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.divide(value, tolerance, dtype=np.float32)
    undefined = np.isnan(out)
    if undefined.any():
        out[undefined] = np.where((flags[undefined] & DIVERGENT) != 0, np.inf, 0.0)
    out[flags == EMPTY] = -1.0
    return out


class ModuleErrors:
    """One candidate's heatmap: rows are (phase, module) in the order first seen, columns are steps."""

    def __init__(self, steps: int, max_rows: int) -> None:
        self.max_rows = max_rows
        self.rows: list[tuple[str, str, str]] = []
        """(phase, baseline name, module type) per row."""
        self._index: dict[tuple[str, str], int] = {}
        self._refused: set[tuple[str, str]] = set()
        self.rows_not_kept = 0
        self._plans: dict[int, tuple[object, np.ndarray, bool]] = {}  # id(plan) -> (plan, row ids, distinct)
        self.timeline: Timeline[ErrorColumn] = Timeline(steps, lambda step: ErrorColumn(step, len(self.rows)))

    def add(self, comparison: StepComparison) -> None:
        rows = comparison.rows
        if not len(rows):
            return
        if isinstance(rows, Rows):
            ids, distinct = self._planned_ids(rows)
            value, tolerance = rows.value, rows.tolerance
            metric, divergent = rows.metric, rows.divergent
        else:  # rows built by hand (tests, tools): the same, row by row
            ids = self._ids([(r.phase, r.name, r.type) for r in rows])
            distinct = len(set(ids[ids >= 0].tolist())) == int((ids >= 0).sum())
            value = np.array([r.value for r in rows], dtype=np.float64)
            tolerance = np.array([r.tolerance for r in rows], dtype=np.float64)
            metric = np.array([METRICS.index(r.metric) for r in rows], dtype=np.int64)
            divergent = np.array([r.divergent for r in rows], dtype=bool)
        flags = (np.asarray(metric, dtype=np.int64) & _METRIC_BITS).astype(np.uint8)
        flags[np.asarray(divergent, dtype=bool)] |= DIVERGENT
        keep = np.flatnonzero(ids >= 0)
        if not distinct:  # several records per row (calls, slots, fused parts): the worst of each
            order = np.lexsort((ratios(value[keep], tolerance[keep], flags[keep]), ids[keep]))
            sorted_ids = ids[keep][order]
            last_of_row = np.append(sorted_ids[1:] != sorted_ids[:-1], True)
            keep = keep[order[last_of_row]]
        column = self.timeline.column(comparison.step)
        column.grow(len(self.rows))
        column.put(ids[keep], value[keep].astype(np.float32), tolerance[keep].astype(np.float32), flags[keep])

    def _planned_ids(self, rows: Rows) -> tuple[np.ndarray, bool]:
        """Row ids of a join plan's pairs, worked out once per plan (plans are kept by the session)."""
        plan = rows.plan
        known = self._plans.get(id(plan))
        if known is not None and known[0] is plan and len(known[1]) == len(rows):
            return known[1], known[2]
        ids = self._ids([(static[0], static[1], static[3]) for static in plan.static_rows])
        kept = ids[ids >= 0]
        distinct = len(np.unique(kept)) == len(kept)
        if len(self._plans) >= _PLANS_KEPT:
            self._plans.clear()
        self._plans[id(plan)] = (plan, ids, distinct)  # the plan is held, so its id is not reused meanwhile
        return ids, distinct

    def _ids(self, labels: list[tuple[str, str, str]]) -> np.ndarray:
        """Row of each (phase, name, type); -1 for module inputs (evidence, not errors) and rows past the cap."""
        out = np.empty(len(labels), dtype=np.int64)
        for k, (phase, name, type_) in enumerate(labels):
            if phase == "input":
                out[k] = -1
                continue
            key = (phase, name)
            row = self._index.get(key)
            if row is None:
                if len(self.rows) >= self.max_rows:
                    if key not in self._refused and len(self._refused) < 4 * self.max_rows:
                        self._refused.add(key)
                        self.rows_not_kept += 1
                    out[k] = -1
                    continue
                row = self._index[key] = len(self.rows)
                self.rows.append((phase, name, type_))
            out[k] = row
        return out

    def copy(self, run: str) -> "ErrorsCopy":
        columns = self.timeline.columns()
        n, m = len(self.rows), len(columns)
        value = np.full((n, m), np.nan, dtype=np.float32)
        tolerance = np.full((n, m), np.nan, dtype=np.float32)
        flags = np.full((n, m), EMPTY, dtype=np.uint8)
        for c, column in enumerate(columns):
            k = min(n, len(column.value))
            value[:k, c] = column.value[:k]
            tolerance[:k, c] = column.tolerance[:k]
            flags[:k, c] = column.flags[:k]
        return ErrorsCopy(
            run=run, rows=tuple(self.rows),
            first_step=np.array([c.first for c in columns], dtype=np.int64),
            last_step=np.array([c.last for c in columns], dtype=np.int64),
            value=value, tolerance=tolerance, flags=flags, rows_not_kept=self.rows_not_kept,
        )


# -- the curves -------------------------------------------------------------------------------------

#: Columns of a curve's per-step figures, in this order.
CURVE_FIELDS = ("baseline_loss", "loss", "baseline_grad_norm", "grad_norm")


class CurveColumn:
    """Sums and counts of the four figures over one step's ranks (or a bucket's steps), and the largest
    differences from the baseline seen in it."""

    __slots__ = ("count", "first", "last", "max_diff", "sums")

    def __init__(self, step: int) -> None:
        self.first = self.last = step
        self.sums = np.zeros(len(CURVE_FIELDS))
        self.count = np.zeros(len(CURVE_FIELDS))
        self.max_diff = np.full(2, np.nan)  # |loss - baseline loss|, |grad norm - baseline grad norm|

    def add(self, figures: np.ndarray) -> None:
        known = ~np.isnan(figures)
        self.sums[known] += figures[known]
        self.count[known] += 1
        diffs = np.abs(figures[[1, 3]] - figures[[0, 2]])
        self.max_diff = np.fmax(self.max_diff, diffs)

    def absorb(self, other: "CurveColumn") -> None:
        self.sums += other.sums
        self.count += other.count
        self.max_diff = np.fmax(self.max_diff, other.max_diff)
        self.first, self.last = min(self.first, other.first), max(self.last, other.last)


class Curve:
    """Loss and global gradient norm of one run and the baseline, per step (rank-averaged)."""

    def __init__(self, steps: int) -> None:
        self.timeline: Timeline[CurveColumn] = Timeline(steps, CurveColumn)

    def add(self, step: int, base: StepData, other: StepData) -> None:
        base_loss, base_norm = loss_and_grad_norm(base)
        loss, norm = loss_and_grad_norm(other)
        self.timeline.column(step).add(np.array([base_loss, loss, base_norm, norm]))

    def copy(self, run: str, reference: bool) -> "CurveCopy":
        columns = self.timeline.columns()
        sums = np.array([c.sums for c in columns]).reshape(len(columns), len(CURVE_FIELDS))
        counts = np.array([c.count for c in columns]).reshape(len(columns), len(CURVE_FIELDS))
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        return CurveCopy(
            run=run, reference=reference,
            first_step=np.array([c.first for c in columns], dtype=np.int64),
            last_step=np.array([c.last for c in columns], dtype=np.int64),
            means=means, max_diff=np.array([c.max_diff for c in columns]).reshape(len(columns), 2),
        )


# -- the session's history, and its copy ----------------------------------------------------------


@dataclass(frozen=True)
class ErrorsCopy:
    """One candidate's heatmap at one moment: [rows, columns] arrays (see ModuleErrors)."""

    run: str
    rows: tuple[tuple[str, str, str], ...]
    first_step: np.ndarray
    last_step: np.ndarray
    value: np.ndarray
    tolerance: np.ndarray
    flags: np.ndarray
    rows_not_kept: int

    def ratio(self) -> np.ndarray:
        return ratios(self.value, self.tolerance, self.flags)


@dataclass(frozen=True)
class CurveCopy:
    """One run against the baseline: per column the means of CURVE_FIELDS and the largest differences."""

    run: str
    reference: bool
    first_step: np.ndarray
    last_step: np.ndarray
    means: np.ndarray
    """[columns, 4] in CURVE_FIELDS order; NaN where not sent."""
    max_diff: np.ndarray
    """[columns, 2]: the largest |loss - baseline loss| and |grad norm - baseline grad norm| in the column."""


@dataclass(frozen=True)
class HistoryCopy:
    """A session's history, copied under its lock: what views and exports are built from."""

    session: str
    errors: tuple[ErrorsCopy, ...]
    curves: tuple[CurveCopy, ...]
    steps: int
    noise_multiple: float
    revision: int = 0
    failure: str = ""
    """Why the history stopped growing ("" while it grows)."""


class SessionHistory:
    """Every candidate's heatmap and every run's curves in one session (used under the session's lock)."""

    def __init__(self, session: str, steps: int, max_rows: int, noise_multiple: float = 3.0) -> None:
        self.session = session
        self.steps = steps
        self.max_rows = max_rows
        self.noise_multiple = noise_multiple
        self._errors: dict[str, ModuleErrors] = {}
        self._curves: dict[str, tuple[Curve, bool]] = {}
        self.revision = 0
        """Bumped by every step added: a view built at the same revision shows the same history."""
        self.failure = ""
        """Why the history stopped growing ("" while it grows)."""

    def add(self, run: str, reference: bool, comparison: StepComparison, base: StepData, other: StepData) -> None:
        """One compared step of ``run`` (a candidate, or a reference rerun: curves only).

        Never raises: the dashboard's history must not cost the comparison anything but time.  A failure
        is logged once and the history stops growing (``failure`` says why; views show what it holds).
        """
        if self.failure:
            return
        try:
            self._add(run, reference, comparison, base, other)
        except Exception as exc:  # a bug here must not end the stream that brought the step
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.exception("session %s: the dashboard's history stopped at step %d (the comparison goes on)",
                             self.session, comparison.step)

    def _add(self, run: str, reference: bool, comparison: StepComparison, base: StepData, other: StepData) -> None:
        if not reference:
            errors = self._errors.get(run)
            if errors is None:
                errors = self._errors[run] = ModuleErrors(self.steps, self.max_rows)
            errors.add(comparison)
        curve = self._curves.get(run)
        if curve is None:
            curve = self._curves[run] = (Curve(self.steps), reference)
        curve[0].add(comparison.step, base, other)
        self.revision += 1

    def copy(self) -> HistoryCopy:
        """Everything, copied (the caller holds the session's lock)."""
        errors = tuple(module_errors.copy(run) for run, module_errors in self._errors.items())
        curves = tuple(curve.copy(run, reference) for run, (curve, reference) in self._curves.items())
        return HistoryCopy(self.session, errors, curves, self.steps, self.noise_multiple, self.revision,
                           self.failure)


def cell_bytes(rows: int, steps: int) -> int:
    """The most one candidate's heatmap holds: 2 x steps columns of 9 bytes per row."""
    return rows * 2 * steps * 9
