"""Each record's relation to its logical tensor, read off StepRecords.placements and validated.

A record without a placement is whole on its rank.  A BLOCK is the slice
[offset, offset + shape) of a logical tensor of ``global_shape`` in the stored
layout; ranks with equal offsets hold replicas of it.  PARTIAL is a sum
awaiting its reduction (never merged); MEAN is one value of a mean over ranks.
"""

from __future__ import annotations

from typing import NamedTuple

from twinstep.server.errors import invalid
from twinstep.v1 import twinstep_pb2 as pb

BLOCK = pb.Placement.BLOCK
PARTIAL = pb.Placement.PARTIAL
MEAN = pb.Placement.MEAN
_KINDS = {BLOCK: "block", PARTIAL: "partial", MEAN: "mean"}
MAX_SPLIT_BY = 64


class RecordPlacement(NamedTuple):
    """One record's placement: ``kind`` and, for a block, where it sits in the logical tensor.

    A tuple, so that a step's placements hash at C speed (they key the merge plans).
    """

    kind: int
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    scale: float = 1.0
    split_by: str = ""

    @property
    def kind_name(self) -> str:
        return _KINDS[self.kind]


def whole(shape: tuple[int, ...]) -> RecordPlacement:
    """The placement of a record with none on the wire: the whole logical tensor."""
    return RecordPlacement(BLOCK, tuple(shape), (0,) * len(shape))


def read_placements(message: pb.StepRecords, shapes: list[tuple[int, ...]]) -> dict[int, RecordPlacement]:
    """record index -> its placement; raises InputError naming the first one that cannot be right."""
    out: dict[int, RecordPlacement] = {}
    step = message.step
    for entry in message.placements:
        i = entry.record
        if i >= len(shapes):
            raise invalid(f"step {step}: a placement names record {i}, but the step has {len(shapes)} records")
        if i in out:
            raise invalid(f"step {step}: record {i} has two placements")
        if entry.kind not in _KINDS:
            raise invalid(f"step {step}: record {i} has placement kind {entry.kind} (expected BLOCK, PARTIAL or MEAN)")
        scale = entry.scale or 1.0
        if not (scale == scale and abs(scale) != float("inf")):
            raise invalid(f"step {step}: record {i} has placement scale {entry.scale}; it must be finite")
        split_by = entry.split_by[:MAX_SPLIT_BY]
        shape = shapes[i]
        if entry.kind == BLOCK:
            glob, offset = tuple(entry.global_shape), tuple(entry.offset)
            if len(glob) != len(shape) or len(offset) != len(shape):
                raise invalid(f"step {step}: record {i} of shape {list(shape)} is placed in a logical tensor of "
                              f"shape {list(glob)} at offset {list(offset)}: both need {len(shape)} entries")
            for d, (n, g, o) in enumerate(zip(shape, glob, offset)):
                if o < 0 or g < 0 or o + n > g:
                    raise invalid(f"step {step}: record {i} of shape {list(shape)} at offset {list(offset)} does "
                                  f"not fit its logical tensor of shape {list(glob)} (dimension {d})")
            out[i] = RecordPlacement(BLOCK, glob, offset, scale, split_by)
        elif entry.kind == MEAN:
            if _numel(shape) != 1:
                raise invalid(f"step {step}: record {i} of shape {list(shape)} is placed as a MEAN over ranks; only "
                              "one-element records can be (a loss)")
            out[i] = RecordPlacement(MEAN, tuple(shape), (0,) * len(shape), scale, split_by)
        else:
            out[i] = RecordPlacement(PARTIAL, tuple(shape), (0,) * len(shape), scale, split_by)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
