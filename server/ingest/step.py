"""One decoded step: what compare, align and detect see of a StepRecords."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twinstep.server.ingest.layouts import records_key
from twinstep.server.ingest.pieces import TensorData


@dataclass
class StepData:
    """All records of one (run, rank, step), as arrays plus per-record names."""

    step: int
    rank: int
    phase: np.ndarray  # int, pb.Phase values (twinstep.wire.phases)
    names: list[str]
    types: list[str]  # module type (FORWARD/BACKWARD) or owning module type (GRAD/PARAM)
    call_index: np.ndarray
    slot: np.ndarray
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    table: dict[str, np.ndarray]
    payloads: dict[int, TensorData]
    """record index -> its full tensor, for records sent with one."""
    nbytes: int
    sketch_rows: dict[int, int] = field(default_factory=dict)
    """record index -> row of ``sketches``."""
    sketches: np.ndarray | None = None
    """[rows, buckets] count-sketches (twinstep.wire.sketch) of some records, or None."""
    sketch_spec: tuple[int, int] = (0, 0)
    """(buckets, seed): sketches of two runs compare only when these agree."""
    layout_key: tuple | None = None
    """Set by decode_step; see :attr:`layout`."""
    placements: dict = field(default_factory=dict)
    """record index -> its RecordPlacement (twinstep.server.layouts.placement) where the run declared one."""

    def __len__(self) -> int:
        return len(self.names)

    @property
    def layout(self) -> tuple:
        """Everything about the records that stays the same from step to step of one training (compared
        exactly, not by hash): the key of the join plans in twinstep.server.compare.plan."""
        if self.layout_key is None:  # a StepData built by hand, not by decode_step
            records = records_key(self.names, self.types, self.phase, self.dtypes, self.shapes)
            self.layout_key = (records, self.call_index.tobytes(), self.slot.tobytes())
        return self.layout_key
