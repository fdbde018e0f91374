"""Parameters in pieces of bounded size, and back: shared by both ends of weight sync.

A model's parameters go from the baseline to the server (PublishWeights) and
from the server to a candidate (FetchWeights) as ``WeightPiece`` messages of
at most ``PIECE_BYTES`` of storage each, so no model, however large, nears
gRPC's message limit (4 MiB by default on a receiving client).  Values travel
in their storage dtype (bfloat16 as its bit pattern) and arrive bit for bit.
The assembler checks every piece against what was announced before it
allocates or copies anything, so a corrupt or hostile stream raises
``PieceError`` instead of exhausting memory or filling a tensor halfway.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

from twinstep.wire import codec
from twinstep.v1 import twinstep_pb2 as pb

#: Storage bytes per piece: a 1 MiB message costs gRPC far less than copying it, and stays
#: well under every default message limit.
PIECE_BYTES = 1 << 20
#: Parameters one upload or request may list.
MAX_PARAMETERS = 1_000_000
#: Longest parameter or module name accepted.
MAX_NAME = 1000


class PieceError(ValueError):
    """Pieces that do not make up the parameters they were announced for."""


def storage_of(array: np.ndarray) -> np.ndarray:
    """A flat little-endian C-order view (or copy) of a storage array."""
    return codec.little_endian(array).reshape(-1)


def pieces(parameter: int, storage: np.ndarray, compress: bool = False,
           piece_bytes: int = PIECE_BYTES) -> Iterator[pb.WeightPiece]:
    """The pieces of one parameter's flat storage array, in element order (none for an empty one)."""
    flat = storage_of(storage)
    per_piece = max(1, piece_bytes // max(1, flat.itemsize))
    compressor = zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL) if compress else None
    for start in range(0, flat.size, per_piece):
        part = flat[start:start + per_piece]
        data = part.tobytes()
        kind = pb.RAW
        if compressor is not None:
            packed = compressor.compress(data)
            if len(packed) < len(data):
                data, kind = packed, pb.ZSTD
        yield pb.WeightPiece(parameter=parameter, offset=start, numel=part.size, codec=kind,
                             raw_nbytes=part.size * flat.itemsize, data=data)


@dataclass(frozen=True)
class Expected:
    """What one parameter's pieces must add up to."""

    name: str
    dtype: str
    """Neutral dtype name of the pieces (twinstep.wire.codec)."""
    numel: int


class Assembler:
    """Collects pieces into one flat storage array per parameter, each checked as it arrives."""

    def __init__(self, expected: Mapping[int, Expected]) -> None:
        self._expected = dict(expected)
        self._arrays: dict[int, np.ndarray] = {}
        self._filled: dict[int, int] = {}
        self.bytes = 0
        """Storage bytes received so far."""

    def add(self, piece: pb.WeightPiece) -> None:
        want = self._expected.get(piece.parameter)
        if want is None:
            raise PieceError(f"a piece names parameter {piece.parameter}, which was not announced")
        filled = self._filled.get(piece.parameter, 0)
        if piece.offset != filled:
            raise PieceError(f"parameter {want.name!r}: a piece starts at element {piece.offset}, expected {filled}")
        if piece.numel == 0 or filled + piece.numel > want.numel:
            raise PieceError(f"parameter {want.name!r}: a piece of {piece.numel} elements at {piece.offset} "
                             f"does not fit its {want.numel}")
        try:
            values = codec.decode_storage(piece.codec, piece.data, piece.raw_nbytes, want.dtype, piece.numel)
        except codec.PayloadError as error:
            raise PieceError(f"parameter {want.name!r}, piece at element {piece.offset}: {error}") from None
        array = self._arrays.get(piece.parameter)
        if array is None:
            array = self._arrays[piece.parameter] = np.empty(want.numel, dtype=codec.storage_dtype(want.dtype))
        array[filled:filled + piece.numel] = values
        self._filled[piece.parameter] = filled + piece.numel
        self.bytes += values.nbytes

    def missing(self) -> list[str]:
        """Parameters not yet complete: '<name>: k of n elements'."""
        return [f"{want.name}: {self._filled.get(pid, 0)} of {want.numel} elements"
                for pid, want in self._expected.items() if self._filled.get(pid, 0) != want.numel]

    def finish(self) -> dict[int, np.ndarray]:
        """Every parameter's flat storage array; PieceError if one is incomplete."""
        missing = self.missing()
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise PieceError("the pieces ended before every parameter was complete: " + "; ".join(missing[:5]) + more)
        for pid, want in self._expected.items():
            if want.numel == 0:
                self._arrays[pid] = np.empty(0, dtype=codec.storage_dtype(want.dtype))
        return self._arrays
