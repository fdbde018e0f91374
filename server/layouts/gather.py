"""One run's ranks' steps, held until a step is whole: every rank sent it, or the missing never will.

Steps leave in order (the alignment window downstream takes a run's steps in
ascending order).  A rank that has sent a later step, or whose stream ended,
will not send an earlier one, so a step it lacks is released without it; its
shards are then missing and their records are not merged (named, not guessed).
Bounded: beyond ``max_steps`` held, the oldest is released as it is.
"""

from __future__ import annotations

from collections import OrderedDict

from twinstep.server.ingest.step import StepData


class StepGather:
    def __init__(self, world_size: int, max_steps: int) -> None:
        self.world_size = max(world_size, 1)
        self.max_steps = max(max_steps, 1)
        self._pending: OrderedDict[int, dict[int, StepData]] = OrderedDict()
        self._delivered: dict[int, int] = {}
        self._ended: set[int] = set()

    def delivered(self, rank: int) -> int:
        """The highest step ``rank`` sent (-1: none): a lower one sent again is a resend."""
        return self._delivered.get(rank, -1)

    def add(self, rank: int, data: StepData) -> list[dict[int, StepData]]:
        """Hold a rank's step; returns the steps now whole (rank -> step), in order."""
        if data.step <= self._delivered.get(rank, -1):
            return []
        self._delivered[rank] = data.step
        self._ended.discard(rank)
        if data.step not in self._pending and self._pending and next(reversed(self._pending)) > data.step:
            self._pending[data.step] = {}
            self._pending = OrderedDict(sorted(self._pending.items()))  # a slow rank's step behind others'
        self._pending.setdefault(data.step, {})[rank] = data
        return self._ready()

    def end(self, rank: int) -> list[dict[int, StepData]]:
        """``rank``'s stream ended: the steps it will not complete are released."""
        self._ended.add(rank)
        return self._ready()

    def reopen(self, rank: int) -> None:
        self._ended.discard(rank)

    def pending_steps(self, rank: int) -> int:
        return sum(1 for parts in self._pending.values() if rank in parts)

    def all_ended(self) -> bool:
        return len(self._ended) >= self.world_size

    def held_bytes(self) -> int:
        return sum(d.nbytes for parts in self._pending.values() for d in parts.values())

    def release_all(self) -> int:
        freed = self.held_bytes()
        self._pending.clear()
        return freed

    def _ready(self) -> list[dict[int, StepData]]:
        out: list[dict[int, StepData]] = []
        while self._pending:
            step, parts = next(iter(self._pending.items()))
            missing = [r for r in range(self.world_size) if r not in parts]
            passed = all(r in self._ended or self._delivered.get(r, -1) > step for r in missing)
            if missing and not passed and len(self._pending) <= self.max_steps:
                break
            self._pending.popitem(last=False)
            out.append(parts)
        return out
