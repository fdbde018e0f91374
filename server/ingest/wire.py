"""How the server reads client messages off the wire.

Tensor pieces are most of the bytes a server receives.  Parsing them with
protobuf copies every payload once more; here a piece's header fields are
parsed with protobuf and its ``data`` stays a view of the received buffer.
Anything else, or a piece this fast path does not recognise, goes through
protobuf as usual, so malformed input fails exactly as it would there.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from twinstep.v1 import twinstep_pb2 as pb

_TENSOR_TAG = (pb.ClientMessage.DESCRIPTOR.fields_by_name["tensor"].number << 3) | 2
_DATA_FIELD = pb.TensorPiece.DESCRIPTOR.fields_by_name["data"].number
_MAX_VARINT_BYTES = 10


@dataclass(frozen=True)
class ReceivedPiece:
    """A TensorPiece whose payload was not copied out of the received message."""

    header: pb.TensorPiece
    """Every field but ``data``."""
    data: memoryview


@dataclass(frozen=True)
class Unreadable:
    """Bytes that are no ClientMessage: the stream reader refuses them with INVALID_ARGUMENT.

    A deserializer that raises makes gRPC answer INTERNAL ("Exception deserializing
    request"), which says the server failed; this says the client did.
    """

    nbytes: int
    reason: str


def parse_client_message(buffer: bytes) -> pb.ClientMessage | ReceivedPiece | Unreadable:
    """The request deserializer of Stream (registered by twinstep.server.servicer.add_servicer)."""
    if buffer[:1] == bytes([_TENSOR_TAG]):
        piece = _parse_piece(buffer)
        if piece is not None:
            return piece
    try:
        return pb.ClientMessage.FromString(buffer)
    except DecodeError as error:
        return Unreadable(len(buffer), str(error) or "malformed protobuf")


def _parse_piece(buffer: bytes) -> ReceivedPiece | None:
    """A piece whose ClientMessage holds only its ``tensor`` field; None when it is anything else."""
    length, start = _varint(buffer, 1)
    if length is None or start + length != len(buffer):
        return None
    view = memoryview(buffer)
    header = bytearray()
    data: memoryview | None = None
    pos = start
    while pos < len(buffer):
        tag, after_tag = _varint(buffer, pos)
        if tag is None:
            return None
        wire_type, field = tag & 7, tag >> 3
        if wire_type == 0:
            value, end = _varint(buffer, after_tag)
            if value is None:
                return None
        elif wire_type == 1:
            end = after_tag + 8
        elif wire_type == 5:
            end = after_tag + 4
        elif wire_type == 2:
            size, body = _varint(buffer, after_tag)
            if size is None:
                return None
            end = body + size
            if field == _DATA_FIELD:
                if end > len(buffer):
                    return None
                data = view[body:end]  # protobuf: the last occurrence wins
                pos = end
                continue
        else:
            return None
        if end > len(buffer):
            return None
        header += view[pos:end]
        pos = end
    return ReceivedPiece(pb.TensorPiece.FromString(bytes(header)), data if data is not None else memoryview(b""))


def _varint(buffer: bytes, pos: int) -> tuple[int | None, int]:
    value = shift = 0
    for i in range(pos, min(pos + _MAX_VARINT_BYTES, len(buffer))):
        byte = buffer[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return None, pos
