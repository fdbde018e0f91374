"""Sets of step numbers as sorted, disjoint, inclusive ranges.

A long run delivers, compares or misses steps mostly in order and mostly in
runs, so coverage over a million steps is a handful of ranges.  Adding the
next step after the last range is O(1); anything else is a binary search.
"""

from __future__ import annotations

import bisect
from typing import Iterator


class StepRanges:
    """Disjoint inclusive ranges [first, last], sorted."""

    __slots__ = ("_firsts", "_lasts")

    def __init__(self) -> None:
        self._firsts: list[int] = []
        self._lasts: list[int] = []

    def add(self, first: int, last: int | None = None) -> None:
        """Add the steps first..last (inclusive; one step when last is None)."""
        last = first if last is None else last
        if last < first:
            return
        firsts, lasts = self._firsts, self._lasts
        if not firsts or first > lasts[-1] + 1:  # the common case: past the end
            firsts.append(first)
            lasts.append(last)
            return
        if first >= firsts[-1] and first <= lasts[-1] + 1:  # extends the last range
            lasts[-1] = max(lasts[-1], last)
            return
        # General case: merge every range that touches [first, last].
        lo = bisect.bisect_left(lasts, first - 1)
        hi = bisect.bisect_right(firsts, last + 1)
        if lo < hi:
            first = min(first, firsts[lo])
            last = max(last, lasts[hi - 1])
        firsts[lo:hi] = [first]
        lasts[lo:hi] = [last]

    def __contains__(self, step: int) -> bool:
        i = bisect.bisect_right(self._firsts, step) - 1
        return i >= 0 and step <= self._lasts[i]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._firsts, self._lasts))

    def __len__(self) -> int:
        """Number of ranges."""
        return len(self._firsts)

    def count(self) -> int:
        """Number of steps."""
        return sum(last - first + 1 for first, last in self)

    @property
    def first(self) -> int | None:
        return self._firsts[0] if self._firsts else None

    @property
    def last(self) -> int | None:
        return self._lasts[-1] if self._lasts else None

    def missing_in(self, first: int, last: int) -> Iterator[tuple[int, int]]:
        """The ranges of first..last (inclusive) that are not in the set."""
        at = first
        i = max(bisect.bisect_right(self._firsts, first) - 1, 0)
        while at <= last and i < len(self._firsts):
            if self._lasts[i] < at:
                i += 1
                continue
            if self._firsts[i] > at:
                yield at, min(self._firsts[i] - 1, last)
            at = self._lasts[i] + 1
            i += 1
        if at <= last:
            yield at, last

    def intersect(self, first: int, last: int) -> Iterator[tuple[int, int]]:
        """The ranges of the set within first..last."""
        i = max(bisect.bisect_right(self._firsts, first) - 1, 0)
        while i < len(self._firsts) and self._firsts[i] <= last:
            lo, hi = max(self._firsts[i], first), min(self._lasts[i], last)
            if lo <= hi:
                yield lo, hi
            i += 1
