"""Named records over a run: per candidate and name, how it compared, and where it first diverged.

The report's own section for the values a training names (``Monitor.record``):
for each name, the steps compared and diverged, and at the first divergent
step the two values (a scalar) or the first element that differs and how many
do (an array sent in full), so "input_ids differs at step 3, element [2, 0]:
17 vs 88, 64 of 128 elements" can be read without a debugger.  Fed every
compared step of every candidate; the record rows of a join plan are found
once per plan; the arrays are decoded only at a name's first divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from twinstep.wire import codec
from twinstep.server.compare.comparator import Rows, StepComparison
from twinstep.server.compare.tolerance import METRICS, RECORD
from twinstep.server.ingest.step import StepData
from twinstep.v1 import twinstep_pb2 as pb

#: Names followed per candidate; more are compared (and can be the first divergence) but not listed.
MAX_NAMES = 256
_NAN = float("nan")


@dataclass
class _Named:
    dtype: str
    shape: tuple[int, ...]
    exact: bool
    steps_compared: int = 0
    steps_diverged: int = 0
    last_step: int = -1
    last_diverged: int = -1
    closest: tuple[float, int, int, str, float, float] = (-1.0, -1, 0, "", 0.0, 0.0)
    """(value / tolerance, step, rank, metric, value, tolerance): the closest approach, or the first divergence."""
    first: pb.NamedRecord | None = None


@dataclass
class NamedRecordTracker:
    """candidate run -> name -> what is known of that named value; used under the session's lock."""

    _runs: dict[str, dict[str, _Named]] = field(default_factory=dict)

    def add(self, comparison: StepComparison, base: StepData, cand: StepData) -> None:
        rows = comparison.rows
        found = _record_rows(rows)
        if not found:
            return
        names = self._runs.setdefault(comparison.candidate_run, {})
        value, tolerance, divergent, metric = _columns(rows, found)
        plan_pairs = rows.plan.pairs if isinstance(rows, Rows) else None
        for n, k in enumerate(found):
            row_name = rows.plan.static_rows[k][1] if isinstance(rows, Rows) else rows[k].name
            i, j = (plan_pairs[k][0][0], plan_pairs[k][1][0]) if plan_pairs is not None else _indices(base, cand,
                                                                                                      row_name)
            if i is None or j is None:
                continue
            named = names.get(row_name)
            if named is None:
                if len(names) >= MAX_NAMES:
                    continue
                dtype = base.dtypes[i]
                named = names[row_name] = _Named(dtype, base.shapes[i], dtype not in _FLOATS)
            named.shape = base.shapes[i]
            step = comparison.step
            if step > named.last_step:
                named.last_step = step
                named.steps_compared += 1
            bad = bool(divergent[n])
            if bad and step > named.last_diverged:
                named.last_diverged = step
                named.steps_diverged += 1
            ratio = _ratio(value[n], tolerance[n], bad)
            earlier = named.first is None or (step, comparison.rank) < (named.first.first_step, named.first.rank)
            if bad and earlier:
                named.first = _first(comparison, row_name, named, base, cand, i, j,
                                     METRICS[int(metric[n])], float(value[n]), float(tolerance[n]))
            elif named.first is None and ratio > named.closest[0]:
                named.closest = (ratio, step, comparison.rank, METRICS[int(metric[n])], float(value[n]),
                                 float(tolerance[n]))

    def to_proto(self, run: str) -> list[pb.NamedRecord]:
        out = []
        for name, named in self._runs.get(run, {}).items():
            if named.first is not None:
                record = pb.NamedRecord()
                record.CopyFrom(named.first)
            else:
                _, step, rank, metric, value, tolerance = named.closest
                record = pb.NamedRecord(candidate_run=run, name=name, first_step=-1, rank=rank, metric=metric,
                                        value=value, tolerance=tolerance, baseline_value=_NAN, candidate_value=_NAN,
                                        elements_differing=-1 if not named.exact else 0)
            record.dtype, record.exact = named.dtype, named.exact
            del record.shape[:]
            record.shape.extend(named.shape)
            record.steps_compared, record.steps_diverged = named.steps_compared, named.steps_diverged
            out.append(record)
        return out


_FLOATS = frozenset({"float32", "float16", "bfloat16", "float64"})


def _record_rows(rows) -> list[int]:
    """Indices of the named-record rows (found once per join plan)."""
    if isinstance(rows, Rows):
        found = rows.plan.derived.get("named_records")
        if found is None:
            found = rows.plan.derived["named_records"] = [k for k, p in enumerate(rows.plan.phases) if p == RECORD]
        return found
    return [k for k, row in enumerate(rows) if row.phase == RECORD]


def _columns(rows, found: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(rows, Rows):
        index = np.asarray(found, dtype=np.int64)
        return rows.value[index], rows.tolerance[index], rows.divergent[index], rows.metric[index]
    picked = [rows[k] for k in found]
    return (np.array([r.value for r in picked]), np.array([r.tolerance for r in picked]),
            np.array([r.divergent for r in picked]), np.array([METRICS.index(r.metric) for r in picked]))


def _indices(base: StepData, cand: StepData, name: str) -> tuple[int | None, int | None]:
    """Records of ``name`` on each side (rows built by hand: no plan to read them from)."""
    def find(data: StepData) -> int | None:
        return next((i for i, n in enumerate(data.names) if n == name and data.types[i] == RECORD), None)

    return find(base), find(cand)


def _ratio(value: float, tolerance: float, divergent: bool) -> float:
    if tolerance > 0:
        ratio = float(value) / float(tolerance)
        return ratio if math.isfinite(ratio) else (math.inf if divergent else 0.0)
    return math.inf if divergent else 0.0


def _first(comparison: StepComparison, name: str, named: _Named, base: StepData, cand: StepData, i: int, j: int,
           metric: str, value: float, tolerance: float) -> pb.NamedRecord:
    """The first divergence of a named value, with the values (or the first element) that differ."""
    record = pb.NamedRecord(candidate_run=comparison.candidate_run, name=name, first_step=comparison.step,
                            rank=comparison.rank, metric=metric, value=value, tolerance=tolerance,
                            baseline_value=_NAN, candidate_value=_NAN, elements_differing=-1)
    a, b = _values(base, i), _values(cand, j)
    if int(base.table["count"][i]) == 1 and int(cand.table["count"][j]) == 1:
        # A scalar without its payload: its one value is its sum (or it is not finite).
        a = a if a is not None else np.array(_scalar(base, i))
        b = b if b is not None else np.array(_scalar(cand, j))
    if a is None or b is None:
        return record
    if a.shape != b.shape:
        if a.size == 1 and b.size == 1:
            a, b = a.reshape(()), b.reshape(())
        else:
            return record
    differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    record.elements_differing = int(differ.sum())
    if record.elements_differing:
        index = np.unravel_index(int(np.argmax(differ.reshape(-1))), a.shape) if a.ndim else ()
        record.first_index.extend(int(x) for x in index)
        record.baseline_value, record.candidate_value = float(a[index]), float(b[index])
    return record


def _values(data: StepData, index: int) -> np.ndarray | None:
    payload = data.payloads.get(index)
    if payload is None:
        return None
    try:
        return np.asarray(payload.decode(data.dtypes[index], data.shapes[index]), dtype=np.float64)
    except codec.PayloadError:
        return None


def _scalar(data: StepData, index: int) -> float:
    table = data.table
    if int(table["nan_count"][index]):
        return _NAN
    if int(table["inf_count"][index]):
        return math.inf  # its sign is not in the statistics
    return float(table["sum"][index])
