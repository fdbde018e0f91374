"""What a step's (phase, target, dtype, shape) columns mean under a manifest: resolved once per layout.

A training records the same modules in the same order every step, so the
names, types, dtypes and shapes of its records are validated and resolved
once and reused; what is left per step is the statistics.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from twinstep.wire import phases
from twinstep.wire.codec import WIRE_TO_DTYPE
from twinstep.server.errors import invalid

if TYPE_CHECKING:
    from twinstep.server.ingest.manifest import Manifest

LOSS_NAME = "loss"
#: The type column of a named record (a module's class name for module records).
RECORD_TYPE = "record"
#: Layouts kept per manifest (most recently used): a training has a handful (say, train and eval steps).
MAX_LAYOUTS = 64


@dataclass(frozen=True)
class RecordLayout:
    """The records' names, types, dtypes and shapes, as one step's columns give them."""

    names: list[str]
    types: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    numel: np.ndarray
    key: tuple
    """Compared exactly (not by hash) by the join plans; one object per cached layout."""


class LayoutCache:
    """Record layouts resolved under one manifest (bounded LRU).

    Owned by the :class:`Manifest`, so it lives as long as the stream's
    declarations and is used, as they are, by one stream at a time.  A
    resolved layout stays valid as the manifest grows (it never redefines an
    id); a layout that failed to resolve is not kept, so it is tried again
    once the manifest names what it lacked.
    """

    def __init__(self, size: int = MAX_LAYOUTS) -> None:
        self._size = size
        self._layouts: OrderedDict[tuple, RecordLayout] = OrderedDict()

    def __len__(self) -> int:
        return len(self._layouts)

    def resolve(self, step: int, manifest: "Manifest", phase_column: np.ndarray, targets: np.ndarray,
                dtypes: np.ndarray, ndim: np.ndarray, dims: np.ndarray,
                record_names: tuple[str, ...] = ()) -> RecordLayout:
        """The layout of these columns; raises InputError naming the first record the manifest cannot explain.

        ``record_names``: the step's own names of its named records (phase RECORD), which its targets index.
        """
        key = (phase_column.tobytes(), targets.tobytes(), dtypes.tobytes(), ndim.tobytes(), dims.tobytes(),
               record_names)
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        layout = _resolve(step, manifest, phase_column.tolist(), targets.tolist(), dtypes.tolist(), ndim, dims,
                          record_names)
        self._layouts[key] = layout
        while len(self._layouts) > self._size:
            self._layouts.popitem(last=False)
        return layout


def _resolve(step: int, manifest: "Manifest", phase_values: list[int], targets: list[int], dtype_codes: list[int],
             ndim: np.ndarray, dims: np.ndarray, record_names: tuple[str, ...] = ()) -> RecordLayout:
    shapes: list[tuple[int, ...]] = []
    flat = dims.tolist()
    offset = 0
    for k in ndim.tolist():
        shapes.append(tuple(flat[offset : offset + k]))
        offset += k
    names: list[str] = []
    types: list[str] = []
    dtypes: list[str] = []
    for i, (phase, target, dtype) in enumerate(zip(phase_values, targets, dtype_codes)):
        if phase in phases.MODULE_PHASES:
            module = manifest.modules.get(target)
            if module is None:
                raise invalid(f"step {step}: record {i} names module id {target}, absent from the manifest")
            names.append(module[0])
            types.append(module[1])
        elif phase in phases.PARAM_PHASES:
            param = manifest.parameters.get(target)
            if param is None:
                raise invalid(f"step {step}: record {i} names parameter id {target}, absent from the manifest")
            names.append(param.name)
            types.append(param.module_type)
        elif phase == phases.LOSS:
            names.append(LOSS_NAME)
            types.append("")
        elif phase == phases.RECORD:
            if not 0 <= target < len(record_names):
                raise invalid(f"step {step}: record {i} names record {target}, but the step names "
                              f"{len(record_names)} (record_names)")
            names.append(record_names[target])
            types.append(RECORD_TYPE)
        else:
            raise invalid(f"step {step}: record {i} has unknown phase {phase}")
        name = WIRE_TO_DTYPE.get(dtype)
        if name is None:
            raise invalid(f"step {step}: record {i} has unknown dtype {dtype}")
        dtypes.append(name)
    numel = np.fromiter((math.prod(s) for s in shapes), dtype=np.int64, count=len(shapes))
    key = records_key(names, types, np.asarray(phase_values, dtype=np.int64), dtypes, shapes)
    return RecordLayout(names, types, dtypes, shapes, numel, key)


def records_key(names: list[str], types: list[str], phase_column: np.ndarray, dtypes: list[str],
                shapes: list[tuple[int, ...]]) -> tuple:
    """Everything about the records that stays the same from step to step, as one comparable value."""
    return (tuple(names), tuple(types), phase_column.astype(np.int64, copy=False).tobytes(), tuple(dtypes),
            tuple(shapes))
