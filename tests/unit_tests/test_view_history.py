"""server/view/history.py: the dashboard's bounded heatmap and curves, fed real comparisons."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.unit_tests.test_comparator import Rec, ctx, decoded, model_records
from twinstep.server.compare.comparator import compare_step
from twinstep.server.compare.plan import PlanCache
from twinstep.server.compare.tolerance import METRICS
from twinstep.server.view.history import (DIVERGENT, EMPTY, ModuleErrors, SessionHistory, Timeline, cell_bytes)


class _Span:
    """The smallest column: which steps it covers."""

    def __init__(self, step: int) -> None:
        self.first = self.last = step
        self.steps = [step]

    def absorb(self, other: "_Span") -> None:
        self.first, self.last = min(self.first, other.first), max(self.last, other.last)
        self.steps += other.steps


@pytest.mark.parametrize("steps,fed", [(4, 100), (5, 1000), (128, 100_000)])
def test_latest_steps_keep_a_column_each_and_older_ones_merge_into_equal_buckets(steps, fed):
    timeline = Timeline(steps, _Span)
    for step in range(fed):
        timeline.column(step)
    columns = timeline.columns()
    assert len(columns) <= 2 * steps + 1
    assert [c.first for c in columns[-steps:]] == list(range(fed - steps, fed))  # full resolution at the end
    assert all(c.first == c.last for c in columns[-steps:])
    covered = [s for c in columns for s in c.steps]
    assert covered == list(range(fed))  # every step once, in order, nothing lost
    widths = [len(c.steps) for c in columns[:-steps]]
    assert widths == sorted(widths, reverse=True) and max(widths) <= 2 * min(widths[:-1] or widths)


def test_a_late_steps_record_lands_in_the_bucket_that_covers_it():
    timeline = Timeline(2, _Span)
    for step in range(20):
        timeline.column(step)
    late = timeline.column(5)  # a slow rank's step, long after its column was merged
    assert late.first <= 5 <= late.last
    assert timeline.column(19) is timeline.columns()[-1]


def _comparison(step: int, perturb: dict[str, float] | None = None, plans: PlanCache | None = None, rank: int = 0):
    base = decoded(model_records(), step=step, rank=rank)
    cand = decoded(model_records(perturb=perturb), step=step, rank=rank)
    context = ctx()
    context.plans = plans
    return compare_step(base, cand, context), base, cand


def test_each_module_keeps_its_worst_record_and_verdict():
    errors = ModuleErrors(steps=3, max_rows=100)
    plans = PlanCache()
    for step in range(10):
        perturb = {"forward:layers.1": 1e-2} if step == 4 else {}
        errors.add(_comparison(step, perturb, plans)[0])
    copied = errors.copy("cand")
    row = copied.rows.index(("forward", "layers.1", "Linear"))
    bucket = next(c for c in range(len(copied.first_step)) if copied.first_step[c] <= 4 <= copied.last_step[c])
    assert copied.last_step[bucket] < 7  # step 4 is merged with others: not one of the 3 latest
    assert copied.flags[row, bucket] & DIVERGENT
    assert METRICS[copied.flags[row, bucket] & 0x7F] in ("rms", "mean", "extrema")
    assert copied.value[row, bucket] > copied.tolerance[row, bucket]
    # Every other cell of that row, and every other row, stayed within tolerance.
    others = np.ones_like(copied.flags, dtype=bool)
    others[row, bucket] = False
    assert not (copied.flags[others] & DIVERGENT).any()
    assert (copied.flags != EMPTY).all()  # every row was compared in every column


def test_module_inputs_are_evidence_not_rows():
    records = model_records() + [Rec("input", "layers.1", np.ones((2, 4, 8), np.float32))]
    base, cand = decoded(records, step=0), decoded(records, step=0)
    errors = ModuleErrors(steps=4, max_rows=100)
    errors.add(compare_step(base, cand, ctx()))
    assert all(phase != "input" for phase, _, _ in errors.rows)
    assert ("forward", "layers.1", "Linear") in errors.rows


def test_rows_past_the_cap_are_counted_not_kept():
    errors = ModuleErrors(steps=4, max_rows=3)
    for step in range(3):
        errors.add(_comparison(step)[0])
    copied = errors.copy("cand")
    assert len(copied.rows) == 3 and copied.value.shape == (3, 3)
    assert copied.rows_not_kept == len(model_records()) - 3  # each refused row counted once, not per step


def test_memory_stays_bounded_over_a_long_run_of_many_modules():
    """40,000 steps of 2,000 modules: the history holds 2 x steps columns, not 40,000 (the 100,000-step
    case of the bound is the timeline test above; here the cells are real)."""
    records = [Rec("forward", f"blocks.{k // 10}.m{k % 10}", np.full((4,), 1.0 + k, np.float32)) for k in range(2000)]
    base = decoded(records, step=0)
    comparison = compare_step(base, base, ctx())
    errors = ModuleErrors(steps=32, max_rows=5000)
    for step in range(40_000):
        errors.add(dataclasses.replace(comparison, step=step))
    columns = errors.timeline.columns()
    held = sum(c.value.nbytes + c.tolerance.nbytes + c.flags.nbytes for c in columns)
    assert len(columns) <= 2 * 32 + 1
    assert held <= cell_bytes(2000, 32) + 2000 * 9
    assert columns[0].first == 0 and columns[-1].last == 39_999


def test_ranks_of_a_step_share_its_column_and_curves_average_them():
    history = SessionHistory("s", steps=8, max_rows=100)
    plans = PlanCache()
    for rank in (0, 1):
        comparison, base, cand = _comparison(0, {"forward:head": 1e-2} if rank == 1 else None, plans, rank=rank)
        history.add("cand", False, comparison, base, cand)
    copied = history.copy()
    errors = copied.errors[0]
    assert len(errors.first_step) == 1  # one step, two ranks: one column
    head = errors.rows.index(("forward", "head", "Linear"))
    assert errors.flags[head, 0] & DIVERGENT  # rank 1's worse record won
    curve = copied.curves[0]
    assert curve.run == "cand" and not curve.reference
    np.testing.assert_allclose(curve.means[0, :2], [2.5, 2.5], rtol=1e-6)  # the loss, sent by both ranks


def test_a_reference_run_feeds_curves_only():
    history = SessionHistory("s", steps=8, max_rows=100)
    comparison, base, cand = _comparison(0)
    history.add("rerun", True, comparison, base, cand)
    copied = history.copy()
    assert copied.errors == () and copied.curves[0].reference
    assert copied.revision == 1


def test_curve_buckets_keep_means_and_the_largest_difference():
    history = SessionHistory("s", steps=2, max_rows=10)
    plans = PlanCache()
    for step in range(6):
        comparison, base, cand = _comparison(step, plans=plans)
        cand.table["sum"][cand.phase == 2] += 0.1 * step  # the candidate's loss drifts: 2.5 + 0.1 * step
        history.add("cand", False, comparison, base, cand)
    curve = history.copy().curves[0]
    first = curve.first_step.tolist()
    assert first[0] == 0 and curve.last_step.tolist()[-1] == 5
    merged = 0  # the oldest bucket
    steps = range(curve.first_step[merged], curve.last_step[merged] + 1)
    np.testing.assert_allclose(curve.means[merged, 1], np.mean([2.5 + 0.1 * s for s in steps]), rtol=1e-9)
    np.testing.assert_allclose(curve.max_diff[merged, 0], 0.1 * max(steps), rtol=1e-9)


def test_a_failing_history_stops_growing_and_never_raises(caplog):
    history = SessionHistory("s", steps=4, max_rows=10)
    comparison, base, cand = _comparison(0)
    broken = dataclasses.replace(comparison, rows=None)  # not rows at all: the history cannot read it
    history.add("cand", False, broken, base, cand)
    assert history.failure and "stopped" in caplog.text
    history.add("cand", False, comparison, base, cand)  # later steps are ignored, quietly
    copied = history.copy()
    assert copied.revision == 0 and not any(e.rows for e in copied.errors) and caplog.text.count("stopped") == 1
