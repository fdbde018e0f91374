"""Decode and validate one StepRecords message against its stream's manifest."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from twinstep import stats
from twinstep.codec import WIRE_TO_DTYPE
from twinstep.server.compare.tensors import PieceCollector, TensorData
from twinstep.server.errors import invalid
from twinstep.v1 import twinstep_pb2 as pb

PHASE_NAMES = {
    pb.FORWARD: "forward", pb.LOSS: "loss", pb.BACKWARD: "backward", pb.GRAD: "grad", pb.PARAM: "param", pb.INPUT: "input",
}
#: Phases whose records are parameters (gradients, updated values) rather than module outputs.
PARAM_PHASES = frozenset({pb.GRAD, pb.PARAM})
LOSS_NAME = "loss"
MAX_RECORDS = 2_000_000
MAX_NDIM = 64
MAX_SKETCH_BUCKETS = 4096


@dataclass
class ParameterMeta:
    name: str
    module_type: str


@dataclass
class Manifest:
    """What one stream has declared: ids -> names (append-only, ids unique)."""

    modules: dict[int, tuple[str, str]] = field(default_factory=dict)  # id -> (name, type)
    parameters: dict[int, ParameterMeta] = field(default_factory=dict)
    module_order: list[str] = field(default_factory=list)

    def add(self, message: pb.Manifest) -> None:
        for module in message.modules:
            known = self.modules.get(module.id)
            if known is not None and known != (module.name, module.type):
                raise invalid(f"manifest redefines module id {module.id} ({known[0]!r} -> {module.name!r})")
            if known is None:
                self.modules[module.id] = (module.name, module.type)
                self.module_order.append(module.name)
        for param in message.parameters:
            known_p = self.parameters.get(param.id)
            if known_p is not None and known_p.name != param.name:
                raise invalid(f"manifest redefines parameter id {param.id} ({known_p.name!r} -> {param.name!r})")
            if not param.name:
                raise invalid(f"manifest parameter id {param.id} has no name")
            self.parameters[param.id] = ParameterMeta(param.name, param.module_type)


@dataclass
class StepData:
    """All records of one (run, rank, step), as arrays plus per-record names."""

    step: int
    rank: int
    phase: np.ndarray  # int, pb.Phase values
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
    """[rows, buckets] count-sketches (twinstep.sketch) of some records, or None."""
    sketch_spec: tuple[int, int] = (0, 0)
    """(buckets, seed): sketches of two runs compare only when these agree."""
    layout_key: tuple | None = None
    """Set by decode_step; see :attr:`layout`."""

    def __len__(self) -> int:
        return len(self.names)

    @property
    def layout(self) -> tuple:
        """Everything about the records that stays the same from step to step of one training (compared
        exactly, not by hash): the key of the join plans in twinstep.server.compare.plan."""
        if self.layout_key is None:  # a StepData built by hand, not by decode_step
            records = _records_key(self.names, self.types, self.phase, self.dtypes, self.shapes)
            self.layout_key = (records, self.call_index.tobytes(), self.slot.tobytes())
        return self.layout_key


def decode_step(message: pb.StepRecords, manifest: Manifest, pieces: PieceCollector | None = None) -> StepData:
    """Validate a step against the manifest; raises InputError naming the first problem.

    ``pieces``: the stream's tensor pieces sent ahead of this step (handed over here).
    """
    n = len(message.phase)
    if n > MAX_RECORDS:
        raise invalid(f"step {message.step} has {n} records, over the limit of {MAX_RECORDS}")
    columns = {
        "target": message.target,
        "call_index": message.call_index,
        "slot": message.slot,
        "dtype": message.dtype,
        "ndim": message.ndim,
        "stats.count": message.stats.count,
        "stats.sum": message.stats.sum,
        "stats.sum_sq": message.stats.sum_sq,
        "stats.min": message.stats.min,
        "stats.max": message.stats.max,
        "stats.abs_max": message.stats.abs_max,
        "stats.nan_count": message.stats.nan_count,
        "stats.inf_count": message.stats.inf_count,
    }
    for column, values in columns.items():
        if len(values) != n:
            raise invalid(f"step {message.step}: column {column} has {len(values)} entries, phase has {n}")
    ndim = np.asarray(message.ndim, dtype=np.int64)
    if n and ndim.max() > MAX_NDIM:
        raise invalid(f"step {message.step}: a record claims {int(ndim.max())} dimensions")
    if int(ndim.sum()) != len(message.dims):
        raise invalid(f"step {message.step}: ndim adds up to {int(ndim.sum())} dims, {len(message.dims)} given")
    dims = np.asarray(message.dims, dtype=np.int64)
    if dims.size and dims.min() < 0:
        raise invalid(f"step {message.step}: negative dimension")
    phases = np.asarray(message.phase, dtype=np.int64)
    layout = _record_layout(message.step, manifest, phases, np.asarray(message.target, dtype=np.int64),
                            np.asarray(message.dtype, dtype=np.int64), ndim, dims)
    names, shapes = layout.names, layout.shapes
    count = np.asarray(message.stats.count, dtype=np.int64)
    if not np.array_equal(count, layout.numel):
        bad = int(np.flatnonzero(count != layout.numel)[0])
        raise invalid(f"step {message.step}: record {bad} ({names[bad]!r}) counts {count[bad]} elements, shape {list(shapes[bad])}")
    call_index = np.asarray(message.call_index, dtype=np.int64)
    slot = np.asarray(message.slot, dtype=np.int64)
    table: dict[str, np.ndarray] = {"count": count}  # the columns of stats.FIELDS, in order
    for name in ("sum", "sum_sq", "min", "max", "abs_max"):
        table[name] = np.asarray(getattr(message.stats, name), dtype=np.float64)
    table["nan_count"] = np.asarray(message.stats.nan_count, dtype=np.int64)
    table["inf_count"] = np.asarray(message.stats.inf_count, dtype=np.int64)
    table["m2"] = _m2_column(message, table, n)

    payloads: dict[int, TensorData] = {}
    counts = count.tolist()
    if pieces is not None:
        payloads = pieces.take(message.step, message.tensor_pieces, n, counts)
    elif message.tensor_pieces:
        raise invalid(f"step {message.step} announces {message.tensor_pieces} tensor pieces, none arrived")
    for payload in message.tensors:
        if payload.record >= n:
            raise invalid(f"step {message.step}: tensor payload for record {payload.record}, only {n} records")
        if payload.record in payloads:
            raise invalid(f"step {message.step}: record {payload.record} has a tensor both inline and in pieces")
        payloads[payload.record] = TensorData.from_payload(payload, counts[payload.record])
    return StepData(
        step=message.step,
        rank=message.rank,
        phase=phases,
        names=names,
        types=layout.types,
        call_index=call_index,
        slot=slot,
        dtypes=layout.dtypes,
        shapes=shapes,
        table=table,
        payloads=payloads,
        nbytes=message.ByteSize() + sum(t.nbytes for t in payloads.values()),
        layout_key=(layout.key, call_index.tobytes(), slot.tobytes()),
        **_sketches(message, n),
    )


@dataclass(frozen=True)
class RecordLayout:
    """What a step's (phase, target, dtype, shape) columns mean under a manifest: the same every step."""

    names: list[str]
    types: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    numel: np.ndarray
    key: tuple
    """Compared exactly (not by hash) by the join plans; one object per cached layout."""


#: Record layouts by (manifest, columns); bounded, shared by the sessions of a server.
_LAYOUTS: OrderedDict[tuple, tuple[RecordLayout, Manifest]] = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()
_MAX_LAYOUTS = 512


def _record_layout(step: int, manifest: Manifest, phases: np.ndarray, targets: np.ndarray, dtypes: np.ndarray,
                   ndim: np.ndarray, dims: np.ndarray) -> RecordLayout:
    """Names, types, dtypes and shapes of the records: validated and resolved once per layout.

    A manifest only grows and never redefines an id, so (manifest, its size,
    the columns) determines the result; the manifest is kept with its entry so
    its id cannot be reused while cached.
    """
    key = (id(manifest), len(manifest.modules), len(manifest.parameters), phases.tobytes(), targets.tobytes(),
           dtypes.tobytes(), ndim.tobytes(), dims.tobytes())
    with _LAYOUTS_LOCK:
        found = _LAYOUTS.get(key)
        if found is not None:
            _LAYOUTS.move_to_end(key)
            return found[0]
    layout = _resolve_layout(step, manifest, phases.tolist(), targets.tolist(), dtypes.tolist(), ndim, dims)
    with _LAYOUTS_LOCK:
        _LAYOUTS[key] = (layout, manifest)
        while len(_LAYOUTS) > _MAX_LAYOUTS:
            _LAYOUTS.popitem(last=False)
    return layout


def _resolve_layout(step: int, manifest: Manifest, phases: list[int], targets: list[int], dtype_codes: list[int],
                    ndim: np.ndarray, dims: np.ndarray) -> RecordLayout:
    shapes: list[tuple[int, ...]] = []
    flat = dims.tolist()
    offset = 0
    for k in ndim.tolist():
        shapes.append(tuple(flat[offset : offset + k]))
        offset += k
    names: list[str] = []
    types: list[str] = []
    dtypes: list[str] = []
    for i, (phase, target, dtype) in enumerate(zip(phases, targets, dtype_codes)):
        if phase in (pb.FORWARD, pb.BACKWARD, pb.INPUT):
            module = manifest.modules.get(target)
            if module is None:
                raise invalid(f"step {step}: record {i} names module id {target}, absent from the manifest")
            names.append(module[0])
            types.append(module[1])
        elif phase in (pb.GRAD, pb.PARAM):
            param = manifest.parameters.get(target)
            if param is None:
                raise invalid(f"step {step}: record {i} names parameter id {target}, absent from the manifest")
            names.append(param.name)
            types.append(param.module_type)
        elif phase == pb.LOSS:
            names.append(LOSS_NAME)
            types.append("")
        else:
            raise invalid(f"step {step}: record {i} has unknown phase {phase}")
        name = WIRE_TO_DTYPE.get(dtype)
        if name is None:
            raise invalid(f"step {step}: record {i} has unknown dtype {dtype}")
        dtypes.append(name)
    numel = np.fromiter((math.prod(s) for s in shapes), dtype=np.int64, count=len(shapes))
    key = _records_key(names, types, np.asarray(phases, dtype=np.int64), dtypes, shapes)
    return RecordLayout(names, types, dtypes, shapes, numel, key)


def _records_key(names: list[str], types: list[str], phases: np.ndarray, dtypes: list[str],
                 shapes: list[tuple[int, ...]]) -> tuple:
    return (tuple(names), tuple(types), phases.astype(np.int64, copy=False).tobytes(), tuple(dtypes), tuple(shapes))


def _sketches(message: pb.StepRecords, n: int) -> dict:
    """The step's sketches, validated: record indices ascending and in range, one float32 row each."""
    if not message.HasField("sketches") or not message.sketches.record:
        return {}
    sk = message.sketches
    if not 0 < sk.buckets <= MAX_SKETCH_BUCKETS:
        raise invalid(f"step {message.step}: sketches have {sk.buckets} buckets (1 to {MAX_SKETCH_BUCKETS})")
    records = np.asarray(sk.record, dtype=np.int64)
    if records[-1] >= n or (records.size > 1 and np.any(np.diff(records) <= 0)):
        raise invalid(f"step {message.step}: sketch record indices must be ascending and below {n}")
    expected = records.size * sk.buckets * 4
    if len(sk.values) != expected:
        raise invalid(f"step {message.step}: sketches hold {len(sk.values)} bytes, {records.size} x {sk.buckets} "
                      f"float32 need {expected}")
    values = np.frombuffer(sk.values, dtype="<f4").reshape(records.size, sk.buckets)
    return {
        "sketch_rows": {int(r): k for k, r in enumerate(records.tolist())},
        "sketches": values,
        "sketch_spec": (int(sk.buckets), int(sk.seed)),
    }


def _m2_column(message: pb.StepRecords, table: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Sent m2 (one per record, finite or +Inf, non-negative), or derived from the sums when absent."""
    m2 = message.stats.m2
    if len(m2) == 0:
        return stats.m2_of_sums(table)  # a client that predates m2: cancellation-prone, the best there is
    if len(m2) != n:
        raise invalid(
            f"step {message.step}: column stats.m2 has {len(m2)} entries, phase has {n} (send one per record or none)"
        )
    values = np.asarray(m2, dtype=np.float64)
    bad = np.flatnonzero(np.isnan(values) | (values < 0))
    if bad.size:
        i = int(bad[0])
        raise invalid(
            f"step {message.step}: record {i} has stats.m2 {float(values[i])}; a sum of squared deviations is >= 0"
        )
    return values
