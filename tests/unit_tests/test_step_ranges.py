"""StepRanges against a plain Python set, on random additions."""

from __future__ import annotations

import random

import pytest

from twinstep.server.align.step_ranges import StepRanges


def _ranges_of(steps: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for step in sorted(steps):
        if out and out[-1][1] == step - 1:
            out[-1] = (out[-1][0], step)
        else:
            out.append((step, step))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_set(seed):
    rng = random.Random(seed)
    ranges, truth = StepRanges(), set()
    for _ in range(200):
        first = rng.randrange(0, 300)
        last = first + rng.choice([0, 0, 1, 5, 20])
        ranges.add(first, last)
        truth.update(range(first, last + 1))
        assert list(ranges) == _ranges_of(truth)
    assert ranges.count() == len(truth)
    for step in range(-2, 330):
        assert (step in ranges) == (step in truth)
    lo, hi = rng.randrange(0, 150), rng.randrange(150, 340)
    missing = {s for a, b in ranges.missing_in(lo, hi) for s in range(a, b + 1)}
    assert missing == set(range(lo, hi + 1)) - truth
    inside = {s for a, b in ranges.intersect(lo, hi) for s in range(a, b + 1)}
    assert inside == set(range(lo, hi + 1)) & truth


def test_in_order_additions_stay_one_range():
    ranges = StepRanges()
    for step in range(100_000):
        ranges.add(step)
    assert list(ranges) == [(0, 99_999)] and ranges.first == 0 and ranges.last == 99_999
    assert list(StepRanges().missing_in(3, 5)) == [(3, 5)]
