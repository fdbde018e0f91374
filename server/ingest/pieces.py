"""Full-tensor payloads of a step, streamed ahead of it in pieces.

A client in tensor mode sends each tensor as one or more ``TensorPiece``
messages before the step's ``StepRecords``; the stream's :class:`PieceCollector`
holds them (bounded) until the step arrives and then hands them over as
:class:`TensorData`.  Payloads stay encoded until a comparison needs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from twinstep.wire import codec
from twinstep.server.errors import invalid
from twinstep.v1 import twinstep_pb2 as pb


@dataclass(frozen=True)
class Piece:
    """One encoded slice of a tensor's flat elements.

    ``source`` holds the payload: a view of the received buffer, or the
    received TensorPiece, whose ``data`` is read only when the tensor is
    decoded, since every read of a protobuf bytes field is a copy.
    """

    offset: int
    numel: int
    codec: int
    source: memoryview | pb.TensorPiece
    size: int
    raw_nbytes: int
    quant_step: float = 0.0
    error_bound: float = 0.0

    @classmethod
    def of(cls, message: pb.TensorPiece, offset: int, numel: int,
           data: memoryview | None = None) -> "Piece":
        source = data if data is not None else message
        size = data.nbytes if data is not None else message.ByteSize()
        return cls(offset, numel, message.codec, source, size, message.raw_nbytes, message.quant_step,
                   message.error_bound)

    @property
    def data(self) -> bytes | memoryview:
        return self.source if isinstance(self.source, memoryview) else self.source.data


@dataclass
class TensorData:
    """One record's full tensor, as the pieces it came in (in element order)."""

    pieces: list[Piece] = field(default_factory=list)

    @property
    def lossy(self) -> bool:
        return any(p.codec == pb.QUANT_ZSTD for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.size for p in self.pieces)

    def decode(self, dtype: str, shape: Sequence[int]) -> np.ndarray:
        """The tensor as numpy (bfloat16 and lossy payloads widen to float32); raises codec.PayloadError."""
        shape = tuple(shape)
        numel = math.prod(shape)
        covered = sum(p.numel for p in self.pieces)
        if covered != numel:
            raise codec.PayloadError(f"pieces hold {covered} elements, shape {list(shape)} has {numel}")
        parts = [
            codec.decode(p.codec, p.data, p.raw_nbytes, dtype, (p.numel,), quant_step=p.quant_step,
                         error_bound=p.error_bound)
            for p in self.pieces
        ]
        if len(parts) == 1:
            return parts[0].reshape(shape)
        return np.concatenate(parts).reshape(shape)  # lossy float16 pieces beside lossless ones: float32


class PieceCollector:
    """The pieces one stream has sent for the step it is about to complete.

    Bounded by ``max_bytes``; a stream that exceeds it, mixes steps, or sends
    pieces out of order is refused with a message naming the problem.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._step: int | None = None
        self._count = 0
        self._bytes = 0
        self._tensors: dict[int, TensorData] = {}
        self._next_offset: dict[int, int] = {}
        self._received: list[tuple[pb.TensorPiece, memoryview | None]] = []

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def add(self, piece: pb.TensorPiece, data: memoryview | None = None) -> None:
        """Hold one piece; ``data``, when given, is its payload (``piece.data`` is then ignored)."""
        if self._step is None:
            self._step = piece.step
        elif piece.step != self._step:
            raise invalid(
                f"tensor piece for step {piece.step} arrived while step {self._step} is incomplete "
                "(send each step's pieces, then its records)"
            )
        item = Piece.of(piece, piece.offset, piece.numel, data)
        self._bytes += item.size
        if self._bytes > self._max_bytes:
            raise invalid(
                f"step {piece.step}: tensor pieces exceed {self._max_bytes} bytes before the step's records "
                "arrived (the server's window_bytes; capture fewer modules or use capture='lossy')"
            )
        expected = self._next_offset.get(piece.record, 0)
        if piece.offset != expected:
            raise invalid(
                f"step {piece.step} record {piece.record}: piece starts at element {piece.offset}, expected {expected}"
            )
        self._next_offset[piece.record] = piece.offset + piece.numel
        self._tensors.setdefault(piece.record, TensorData()).pieces.append(item)
        self._received.append((piece, data))
        for other in piece.same_records:
            if other == piece.record:
                continue
            if self._next_offset.get(other, 0) != piece.offset:
                raise invalid(f"step {piece.step} record {other}: shared piece out of order")
            self._next_offset[other] = piece.offset + piece.numel
            self._tensors.setdefault(other, TensorData()).pieces.append(item)
        self._count += 1

    def take(self, step: int, announced: int, records: int, numel: Sequence[int]) -> dict[int, TensorData]:
        """Hand over the pieces of ``step``, checked against its records; the collector starts afresh."""
        tensors, count, held_step = self._tensors, self._count, self._step
        self._reset()
        if count != announced:
            raise invalid(f"step {step} announces {announced} tensor pieces, {count} arrived before it")
        if count and held_step != step:
            raise invalid(f"step {step} follows tensor pieces of step {held_step}")
        for record, data in tensors.items():
            if record >= records:
                raise invalid(f"step {step}: tensor piece for record {record}, only {records} records")
            covered = data.pieces[-1].offset + data.pieces[-1].numel
            if covered != numel[record]:
                raise invalid(
                    f"step {step} record {record}: tensor pieces cover {covered} of its {numel[record]} elements"
                )
        return tensors

    def received(self) -> list[tuple[pb.TensorPiece, memoryview | None]]:
        """The pieces held, as they arrived (header, payload view or None when the header holds it): for the journal."""
        return list(self._received)

    def discard(self) -> None:
        """Forget incomplete pieces (the stream ended mid-step; the client resends the whole step)."""
        self._reset()

    def _reset(self) -> None:
        self._step = None
        self._count = 0
        self._bytes = 0
        self._tensors = {}
        self._next_offset = {}
        self._received = []
