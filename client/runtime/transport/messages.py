"""Turn a StepBatch into wire messages (runs on the sender thread).

A step goes out as its tensors' pieces (``TensorPiece``, each at most
``piece_bytes`` of storage) followed by its records (``StepRecords``), which
complete it on the server.  Pieces are serialized here, by hand around the
payload, so a tensor's bytes are copied once into the message instead of three
times through protobuf; the stream's serializer passes such bytes through.
Compression releases the GIL, so encoding competes with the training thread
for a core, not for the interpreter.
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping

import numpy as np
import zstandard

from twinstep.wire import codec, phases
from twinstep.runtime.capture.buffers import HostTensor
from twinstep.runtime.capture.recorder import StepBatch
from twinstep.wire.stats import DEVICE_FIELDS
from twinstep.v1 import twinstep_pb2 as pb

_COLUMN = {name: i for i, name in enumerate(DEVICE_FIELDS)}
_COUNTS = ("nan_count", "inf_count")
#: Dtypes the lossy codec quantises; others travel losslessly.
_LOSSY_DTYPES = frozenset({"float32", "float16", "bfloat16"})
#: Storage bytes per piece: big enough that per-message costs vanish, small enough to pipeline.
DEFAULT_PIECE_BYTES = 4 << 20
#: How tensors are compressed: "auto" stops compressing a dtype while zstd saves under MIN_SAVING.
COMPRESSIONS = ("auto", "zstd", "none")
MIN_SAVING = 0.10
_PROBE_EVERY = 64  # pieces sent raw under "auto" before zstd is tried on that dtype again

_CLIENT_MESSAGE_TENSOR = (6 << 3) | 2  # ClientMessage.tensor, length-delimited
_PIECE_DATA = (15 << 3) | 2  # TensorPiece.data, length-delimited


def step_message(batch: StepBatch, rank: int, dropped: dict[str, int], tensor_pieces: int = 0) -> pb.ClientMessage:
    """The StepRecords of one batch.

    ``tensor_pieces``: how many TensorPiece messages of this step went out just before it.
    """
    stats = batch.device_stats
    columns = {
        name: (stats[:, i].astype("int64") if name in _COUNTS else stats[:, i]).tolist() for name, i in _COLUMN.items()
    }
    message = pb.StepRecords(
        rank=rank,
        step=batch.step,
        phase=batch.phase.tolist(),
        target=batch.target.tolist(),
        call_index=batch.call_index.tolist(),
        slot=batch.slot.tolist(),
        dtype=batch.dtype.tolist(),
        ndim=batch.ndim.tolist(),
        dims=batch.dims,
        stats=pb.Statistics(count=batch.count.tolist(), **columns),
        dropped=dropped,
        tensor_pieces=tensor_pieces,
        incomplete=batch.incomplete,
        cost=batch.cost.to_proto(),
        record_names=batch.record_names,
    )
    if batch.ops:
        message.ops.ParseFromString(batch.ops)
    if batch.placements:  # a parallel layout's records that are not whole (twinstep.runtime.capture.placement)
        message.placements.extend(block.to_proto(record) for record, block in batch.placements)
    if batch.sketch_records is not None and len(batch.sketch_records):
        buckets, seed = batch.sketch_spec
        message.sketches.CopyFrom(pb.Sketches(buckets=buckets, seed=seed, record=batch.sketch_records.tolist(),
                                              values=batch.sketches.astype("<f4", copy=False).tobytes()))
    return pb.ClientMessage(step=message)


class TensorEncoder:
    """Encodes a step's tensors into serialized TensorPiece messages; one per sender thread (not thread-safe)."""

    def __init__(self, compression: str = "auto", piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(map(repr, COMPRESSIONS))}, got {compression!r}")
        if piece_bytes < 16:
            raise ValueError(f"piece_bytes must be at least 16, got {piece_bytes}")
        self.compression = compression
        self.piece_bytes = piece_bytes
        self._zstd = zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL)
        self._raw_until: dict[str, int] = {}  # dtype -> pieces left to send raw ("auto")
        self.raw_bytes = 0
        self.wire_bytes = 0

    def pieces(self, batch: StepBatch, host: HostTensor, lossy: Mapping[str, pb.LossyBound] | None) -> list[bytes]:
        """Every piece of one tensor, serialized as ClientMessage bytes."""
        raw = batch.storage_array(host.copy) if batch.storage_array else host.copy
        flat = codec.little_endian(raw).reshape(-1)
        record, same = host.records[0], host.records[1:]
        bound = _error_bound(batch, host.records, host.dtype, lossy) if lossy else 0.0
        per_piece = max(1, self.piece_bytes // max(flat.itemsize, 1))
        out = []
        for offset in range(0, max(flat.size, 1), per_piece):
            part = flat[offset : offset + per_piece]
            header = pb.TensorPiece(step=batch.step, record=record, offset=offset, numel=part.size,
                                    raw_nbytes=part.nbytes, same_records=same)
            if bound > 0:
                kind, data, _, quant_step = codec.encode_quantized(part, bound, dtype=host.dtype)
                header.codec = kind
                if kind == pb.QUANT_ZSTD:
                    header.quant_step, header.error_bound = quant_step, bound
            else:
                header.codec, data = self._lossless(part, host.dtype)
            self.raw_bytes += part.nbytes
            wire = _serialize(header, data)
            self.wire_bytes += len(wire)
            out.append(wire)
        return out

    def _lossless(self, part: np.ndarray, dtype: str) -> tuple[int, bytes | memoryview]:
        view = memoryview(part).cast("B")
        if self.compression == "none" or not part.nbytes:
            return pb.RAW, view
        if self.compression == "auto":
            left = self._raw_until.get(dtype, 0)
            if left > 0:
                self._raw_until[dtype] = left - 1
                return pb.RAW, view
        data = self._zstd.compress(view)
        if self.compression == "auto" and len(data) > (1.0 - MIN_SAVING) * part.nbytes:
            self._raw_until[dtype] = _PROBE_EVERY  # this one is compressed already; the next ones go raw
        return pb.ZSTD, data


def encoded_pieces(batch: StepBatch, encoder: TensorEncoder, lossy: Mapping[str, pb.LossyBound] | None) -> Iterator[bytes]:
    """The step's pieces in order, encoding each tensor once (kept on the batch for a resend after a reconnect)."""
    if batch.copies_ready is not None:
        batch.copies_ready()
        batch.copies_ready = None
    for host in batch.tensors:
        if host.wire is None:
            if host.copy is None:  # released without being encoded: nothing to send
                host.wire = []
            else:
                host.wire = encoder.pieces(batch, host, lossy)
                if batch.release is not None:
                    batch.release(host)
        yield from host.wire


def _serialize(header: pb.TensorPiece, data: bytes | memoryview) -> bytes:
    """ClientMessage(tensor=header with data) as bytes, the payload copied once."""
    head = header.SerializeToString()
    size = len(data) if isinstance(data, bytes) else data.nbytes
    data_prefix = bytes([_PIECE_DATA]) + _varint(size)
    inner = len(head) + len(data_prefix) + size
    return b"".join((bytes([_CLIENT_MESSAGE_TENSOR]), _varint(inner), head, data_prefix, data))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _error_bound(batch: StepBatch, records: list[int], dtype: str, lossy: Mapping[str, pb.LossyBound]) -> float:
    """The largest error an element of a tensor may carry (0: send it losslessly).

    The server's budget is a fraction of the tensor's RMS, known from the
    statistics already computed for it, capped by an absolute budget.  For a
    tensor several records share, the tightest of their phases' budgets applies.
    """
    bounds = []
    for rec in records:
        budget = lossy.get(phases.describe(int(batch.phase[rec])))
        if budget is None or dtype not in _LOSSY_DTYPES:
            return 0.0
        row = batch.device_stats[rec]
        finite = batch.count[rec] - row[_COLUMN["nan_count"]] - row[_COLUMN["inf_count"]]
        if finite <= 0:
            return 0.0
        rms = math.sqrt(max(float(row[_COLUMN["sum_sq"]]), 0.0) / float(finite))
        bounds.append(codec.error_bound(rms, budget.rms_fraction, budget.absolute))
    bound = min(bounds)
    return bound if math.isfinite(bound) and bound > 0 else 0.0
