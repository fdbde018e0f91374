"""Named records: values the training names for the step in progress (``Monitor.record``).

A named record is compared by the server's engine like any other record
(phase ``record``, its name as the module's): statistics always, and the full
value when it is small (``MAX_VALUE_BYTES``), so an integer array such as a
batch's input ids is compared element by element, exactly.  At the end of the
step the records join the step's batch, each at the place in the step where it
was recorded (before the model's first call, after the forward, or after the
backward: ``twinstep.wire.phases.record_position``), so that the first divergence
of a step is the record that starts it: the input ids before the first module,
the learning rate before the parameters it updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinstep.wire import phases
from twinstep.runtime.capture.base import CaptureBackend
from twinstep.runtime.capture.buffers import HostTensor
from twinstep.runtime.capture.recorder import StepBatch
from twinstep.wire.codec import DTYPE_TO_WIRE
from twinstep.runtime.values import HostValue, statistics_row, to_host

#: Values up to this size travel in full (compared element by element); larger ones by their statistics.
#: 8 x 2048 int64 input ids are 128 KiB.
MAX_VALUE_BYTES = 4 << 20
#: Named records in one step, so a call in a loop cannot grow memory without end.
MAX_PER_STEP = 4096
#: Longest name accepted.
MAX_NAME = 256

#: Where a record recorded after the latest record of a phase sits: after the step phases whose rows
#: precede it on the wire (rows go out sorted by phase value: forward, loss, backward, grad, param, input).
_AFTER = {None: frozenset(), phases.FORWARD: frozenset({phases.FORWARD, phases.LOSS}),
          phases.INPUT: frozenset({phases.FORWARD, phases.LOSS}),
          phases.LOSS: frozenset({phases.FORWARD, phases.LOSS}),
          phases.BACKWARD: frozenset({phases.FORWARD, phases.LOSS, phases.BACKWARD, phases.GRAD}),
          phases.GRAD: frozenset({phases.FORWARD, phases.LOSS, phases.BACKWARD, phases.GRAD})}


@dataclass
class _Named:
    name: str
    dtype: str
    shape: tuple[int, ...]
    row: tuple[float, ...]
    """Its statistics (twinstep.wire.stats.DEVICE_FIELDS)."""
    value: HostValue | None
    """Its copy, when small enough to travel in full (else None: it was let go once its statistics were taken)."""
    after: int | None
    """The phase of the latest record of the step when this one was recorded (None: before any)."""


class NamedRecords:
    """The step's named records, held until the step ends; used on the training thread only."""

    def __init__(self, max_value_bytes: int = MAX_VALUE_BYTES) -> None:
        self.max_value_bytes = max_value_bytes
        self._pending: list[_Named] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, name: str, value: Any, after: int | None) -> None:
        """Copy ``value`` for the step in progress; UnsupportedValue for one that cannot travel."""
        if len(self._pending) >= MAX_PER_STEP:
            raise RuntimeError(f"more than {MAX_PER_STEP} named records in one step; the rest of this step's "
                               "are not recorded")
        host = to_host(value)
        kept = host if host.nbytes <= self.max_value_bytes else None
        self._pending.append(_Named(name, host.dtype, host.shape, statistics_row(host), kept, after))

    def discard(self) -> None:
        self._pending = []

    def merge_into(self, batch: StepBatch, backend: CaptureBackend) -> StepBatch:
        """``batch`` with the step's named records inserted where they were recorded; starts a new step."""
        pending, self._pending = self._pending, []
        if not pending:
            return batch
        n = len(batch.phase)
        names: dict[str, int] = {name: i for i, name in enumerate(batch.record_names)}
        calls: dict[str, int] = {}
        rows = []
        for named in pending:
            target = names.setdefault(named.name, len(names))
            call = calls.get(named.name, 0)
            calls[named.name] = call + 1
            before = _AFTER.get(named.after, _AFTER[phases.BACKWARD])
            at = int(np.isin(batch.phase, list(before)).sum()) if before else 0
            rows.append((at, target, call, named))
        rows.sort(key=lambda row: row[0])  # stable: records at one place keep the order they were recorded in
        at = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
        # Old row i moves down by the records inserted at or before it; the j-th record lands at at[j] + j.
        moved = np.arange(n) + np.searchsorted(at, np.arange(n), side="right")
        placed = at + np.arange(len(rows))
        total = n + len(rows)

        def column(old: np.ndarray, new_values: list, dtype: Any) -> np.ndarray:
            out = np.empty(total, dtype=dtype)
            out[moved] = old
            out[placed] = new_values
            return out

        shapes = _shapes(batch)
        all_shapes: list[tuple[int, ...]] = [()] * total
        for i, shape in zip(moved.tolist(), shapes):
            all_shapes[i] = shape
        stats = np.empty((total, batch.device_stats.shape[1] if batch.device_stats.ndim == 2 else 8))
        stats[moved] = batch.device_stats.reshape(n, -1)
        tensors = [_moved(host, moved) for host in batch.tensors]
        for k, (_, target, call, named) in enumerate(rows):
            index = int(placed[k])
            all_shapes[index] = named.shape
            stats[index] = named.row
            if named.value is not None:
                tensors.append(HostTensor([index], named.dtype, backend.wrap_host(named.value.storage), None,
                                          named.value.nbytes))
        batch.phase = column(batch.phase, [phases.RECORD] * len(rows), batch.phase.dtype)
        batch.target = column(batch.target, [row[1] for row in rows], batch.target.dtype)
        batch.call_index = column(batch.call_index, [row[2] for row in rows], batch.call_index.dtype)
        batch.slot = column(batch.slot, [0] * len(rows), batch.slot.dtype)
        batch.dtype = column(batch.dtype, [DTYPE_TO_WIRE[row[3].dtype] for row in rows], batch.dtype.dtype)
        batch.ndim = np.asarray([len(s) for s in all_shapes], dtype=np.uint32)
        batch.dims = [d for s in all_shapes for d in s]
        batch.count = np.asarray([math.prod(s) for s in all_shapes], dtype=np.int64)
        batch.device_stats = stats
        batch.tensors = tensors
        if batch.sketch_records is not None:
            batch.sketch_records = moved[batch.sketch_records.astype(np.int64)].astype(np.uint32)
        batch.placements = [(int(moved[record]), block) for record, block in batch.placements]
        batch.record_names = list(names)
        return batch


def _shapes(batch: StepBatch) -> list[tuple[int, ...]]:
    out, offset = [], 0
    for k in batch.ndim.tolist():
        out.append(tuple(batch.dims[offset : offset + k]))
        offset += k
    return out


def _moved(host: HostTensor, moved: np.ndarray) -> HostTensor:
    host.records = [int(moved[i]) for i in host.records]
    return host
