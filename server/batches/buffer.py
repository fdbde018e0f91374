"""The batches one session's baseline published, held until candidates fetch them, within a memory budget.

A baseline rank publishes the inputs of each step (``PublishBatch``); the same
rank of each candidate fetches them (``GetBatch``), possibly much later: the
baseline may run ahead.  Batches are keyed by (rank, step), so rank r only ever
gets rank r's.  The buffer holds at most ``budget_bytes``; to make room it drops
batches some candidate already took first (oldest step first), then the oldest
untaken ones, and counts every drop, so a candidate that asks for a dropped
step hears why at once instead of waiting out its timeout.

A candidate asking for a step not yet published waits on a condition, bounded
by the caller's deadline: never longer than the RPC's ``wait_seconds`` (capped
by the server), so a waiting handler thread is freed within seconds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from twinstep.v1 import twinstep_pb2 as pb

#: Drops remembered per session, so a late request for a dropped step is told so (oldest forgotten first).
_MAX_REMEMBERED_DROPS = 100_000


@dataclass
class _Held:
    batch: pb.PublishedBatch
    nbytes: int
    taken: int = 0
    """How many times a candidate fetched it."""


@dataclass
class BatchCounts:
    """What the buffer did, for the report (Report.batch_sync)."""

    published: int = 0
    delivered: int = 0
    dropped: int = 0
    refused: int = 0
    held_bytes: int = 0
    budget_bytes: int = 0

    def to_proto(self) -> pb.BatchSync:
        return pb.BatchSync(published=self.published, delivered=self.delivered, dropped=self.dropped,
                            refused=self.refused, held_bytes=self.held_bytes, budget_bytes=self.budget_bytes)


@dataclass
class Lookup:
    """The answer to one request: the batch, or why there is none (yet)."""

    batch: pb.PublishedBatch | None = None
    dropped: bool = False
    """The step was published and dropped to stay within the budget: it will not come again."""
    waited: float = 0.0


@dataclass
class BatchBuffer:
    """(rank, step) -> the published batch; thread-safe (its own lock, never the session's)."""

    budget_bytes: int
    _held: "OrderedDict[tuple[int, int], _Held]" = field(default_factory=OrderedDict)
    _dropped: "OrderedDict[tuple[int, int], None]" = field(default_factory=OrderedDict)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    counts: BatchCounts = field(default_factory=BatchCounts)

    def __post_init__(self) -> None:
        self.counts.budget_bytes = self.budget_bytes

    def publish(self, batch: pb.PublishedBatch, nbytes: int) -> None:
        """Hold one batch (a step published again replaces the earlier copy), dropping others to fit."""
        key = (batch.rank, batch.step)
        with self._cond:
            old = self._held.pop(key, None)
            if old is not None:
                self.counts.held_bytes -= old.nbytes
            self._dropped.pop(key, None)
            self._held[key] = _Held(batch, nbytes)
            self.counts.held_bytes += nbytes
            self.counts.published += 1
            self._make_room(keep=key)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._held)

    def refused(self) -> None:
        with self._cond:
            self.counts.refused += 1

    def take(self, rank: int, step: int, wait: float) -> Lookup:
        """The batch of (rank, step), waiting up to ``wait`` seconds for it to be published."""
        key = (rank, step)
        start = time.monotonic()
        deadline = start + max(wait, 0.0)
        with self._cond:
            while True:
                held = self._held.get(key)
                if held is not None:
                    held.taken += 1
                    self.counts.delivered += 1
                    return Lookup(batch=held.batch, waited=time.monotonic() - start)
                if key in self._dropped:
                    return Lookup(dropped=True, waited=time.monotonic() - start)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return Lookup(waited=time.monotonic() - start)
                self._cond.wait(remaining)

    def latest_step(self, rank: int) -> int:
        """The highest step of ``rank`` published and still held (-1: none)."""
        with self._cond:
            return max((step for r, step in self._held if r == rank), default=-1)

    def snapshot(self) -> BatchCounts:
        with self._cond:
            return BatchCounts(**vars(self.counts))

    def release_all(self) -> int:
        """Free every held batch (the session's runs have all ended); returns the bytes freed."""
        with self._cond:
            freed = self.counts.held_bytes
            for key in self._held:  # a candidate that still asks is told they were dropped
                self._dropped[key] = None
            while len(self._dropped) > _MAX_REMEMBERED_DROPS:
                self._dropped.popitem(last=False)
            self._held.clear()
            self.counts.held_bytes = 0
            return freed

    def _make_room(self, keep: tuple[int, int]) -> None:
        """Drop taken batches first, then the oldest steps, until the budget holds (caller holds the lock)."""
        if self.counts.held_bytes <= self.budget_bytes:
            return
        by_age = sorted(self._held, key=lambda k: (self._held[k].taken == 0, k[1], k[0]))
        for key in by_age:
            if self.counts.held_bytes <= self.budget_bytes:
                break
            if key == keep:
                continue
            held = self._held.pop(key)
            self.counts.held_bytes -= held.nbytes
            self.counts.dropped += held.taken == 0  # a batch no candidate took: one may still ask for it
            self._dropped[key] = None
            while len(self._dropped) > _MAX_REMEMBERED_DROPS:
                self._dropped.popitem(last=False)
