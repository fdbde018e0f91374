"""Decode and validate one StepRecords message against its stream's manifest."""

from __future__ import annotations

import numpy as np

from twinstep.server.errors import invalid
from twinstep.server.ingest.manifest import Manifest
from twinstep.server.ingest.pieces import PieceCollector, TensorData
from twinstep.server.ingest.step import StepData
from twinstep.server.layouts.placement import read_placements
from twinstep.v1 import twinstep_pb2 as pb

MAX_RECORDS = 2_000_000
MAX_NDIM = 64
MAX_SKETCH_BUCKETS = 4096
MAX_RECORD_NAMES = 4096
MAX_RECORD_NAME = 256


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
    phase_column = np.asarray(message.phase, dtype=np.int64)
    layout = manifest.layouts.resolve(message.step, manifest, phase_column, np.asarray(message.target, dtype=np.int64),
                                      np.asarray(message.dtype, dtype=np.int64), ndim, dims,
                                      record_names(message))
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
    table["m2"] = _m2_column(message, n)

    payloads: dict[int, TensorData] = {}
    if pieces is not None:
        payloads = pieces.take(message.step, message.tensor_pieces, n, count.tolist())
    elif message.tensor_pieces:
        raise invalid(f"step {message.step} announces {message.tensor_pieces} tensor pieces, none arrived")
    placements = read_placements(message, shapes) if message.placements else {}
    return StepData(
        placements=placements,
        step=message.step,
        rank=message.rank,
        phase=phase_column,
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


def record_names(message: pb.StepRecords) -> tuple[str, ...]:
    """The step's names of named records (phase RECORD), checked: unique, non-empty, bounded."""
    names = tuple(message.record_names)
    if len(names) > MAX_RECORD_NAMES:
        raise invalid(f"step {message.step} names {len(names)} records, over the limit of {MAX_RECORD_NAMES}")
    if len(set(names)) != len(names):
        raise invalid(f"step {message.step}: record_names lists a name twice")
    for name in names:
        if not name or len(name) > MAX_RECORD_NAME:
            raise invalid(f"step {message.step}: a record name must have 1 to {MAX_RECORD_NAME} characters, "
                          f"got {name[:40]!r}")
    return names


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


def _m2_column(message: pb.StepRecords, n: int) -> np.ndarray:
    """Sent m2: one per record, finite or +Inf, non-negative."""
    m2 = message.stats.m2
    if len(m2) != n:
        if not m2:
            raise invalid(f"step {message.step}: missing m2 (column stats.m2 is empty; send one per record)")
        raise invalid(f"step {message.step}: column stats.m2 has {len(m2)} entries, phase has {n} (one per record)")
    values = np.asarray(m2, dtype=np.float64)
    bad = np.flatnonzero(np.isnan(values) | (values < 0))
    if bad.size:
        i = int(bad[0])
        raise invalid(
            f"step {message.step}: record {i} has stats.m2 {float(values[i])}; a sum of squared deviations is >= 0"
        )
    return values
