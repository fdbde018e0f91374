"""Which compared steps carried full tensors, per candidate rank: what a zoom really brought.

A zoom is a request; whether a step of a rank was compared with full tensors
depends on both runs applying it in time.  The ledger reads that off each
comparison (a pair both of whose records arrived with a payload) and keeps,
per candidate and rank, runs of consecutive steps with the same record names
and the worst rel_l2 and cosine gap among them.  Bounded: at most
``MAX_RANGES`` ranges per rank (later ones are counted) and ``MAX_NAMES``
names per range.  Costs nothing for a step without payloads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twinstep.server.compare.comparator import Rows, StepComparison
from twinstep.server.ingest.step import StepData
from twinstep.v1 import twinstep_pb2 as pb

MAX_RANGES = 64
MAX_NAMES = 32


@dataclass
class _Range:
    first: int
    last: int
    names: tuple[str, ...]
    max_rel_l2: float
    max_cosine: float


class TensorStepLedger:
    """Per (candidate, rank): ranges of steps compared with full tensors (call under the session's lock)."""

    def __init__(self) -> None:
        self._ranges: dict[tuple[str, int], list[_Range]] = {}
        self._unlisted: dict[tuple[str, int], int] = {}

    def observe(self, comparison: StepComparison, base: StepData, cand: StepData) -> None:
        """Note the records of one compared step whose full tensors were compared."""
        if not base.payloads or not cand.payloads or not isinstance(comparison.rows, Rows):
            return
        plan = comparison.rows.plan
        compared = [k for k, i, j, _ in plan.tensor_pairs if i in base.payloads and j in cand.payloads]
        if not compared:
            return
        names = tuple(sorted({plan.static_rows[k][1] for k in compared}))
        rel_l2 = _worst(comparison.values.get("rel_l2"), compared)
        cosine = _worst(comparison.values.get("cosine"), compared)
        key = (comparison.candidate_run, comparison.rank)
        ranges = self._ranges.setdefault(key, [])
        last = ranges[-1] if ranges else None
        if last is not None and last.names == names and comparison.step == last.last + 1:
            last.last = comparison.step
            last.max_rel_l2 = max(last.max_rel_l2, rel_l2)
            last.max_cosine = max(last.max_cosine, cosine)
        elif len(ranges) < MAX_RANGES:
            ranges.append(_Range(comparison.step, comparison.step, names, rel_l2, cosine))
        else:
            self._unlisted[key] = self._unlisted.get(key, 0) + 1

    def to_proto(self) -> list[pb.TensorSteps]:
        out = []
        for (run, rank), ranges in sorted(self._ranges.items()):
            for r in ranges:
                out.append(pb.TensorSteps(candidate_run=run, rank=rank, first_step=r.first, last_step=r.last,
                                          modules=r.names[:MAX_NAMES],
                                          modules_unlisted=max(len(r.names) - MAX_NAMES, 0),
                                          max_rel_l2=r.max_rel_l2, max_cosine=r.max_cosine))
        return out

    def unlisted(self) -> int:
        """Steps with full tensors past the bound on ranges, over every rank."""
        return sum(self._unlisted.values())


def _worst(values: np.ndarray | None, rows: list[int]) -> float:
    if values is None or not rows:
        return 0.0
    picked = values[np.asarray(rows)]
    finite = picked[np.isfinite(picked)]
    if len(finite) < len(picked):
        return float("inf")
    return float(finite.max()) if len(finite) else 0.0
