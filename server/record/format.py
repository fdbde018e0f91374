"""The recording file: a session's journal entries, one compressed frame each, readable up to any damage.

Layout (little-endian; docs/recording.md is the reference):

- a file header: ``MAGIC``, the format version (u16), flags (u16, 0), the
  length of a JSON description (u32: session, created, twinstep and protocol
  versions), the JSON, and a CRC-32 of everything before it;
- frames, each a fixed header (``_FRAME``: type, entry kind, flags, stream,
  step, body length, CRC-32 of the body, CRC-32 of the header before it) and a
  body.  The header's own checksum makes skipping a frame by its kind or
  stream safe: a damaged header is an error, never a frame silently skipped.  An ``ENTRY``
  frame's body is one journal entry (twinstep.server.journal.entries: its
  header, then its payload), zstandard-compressed unless that would not pay
  (tensor payloads the client compressed already); ``NOTE`` frames say that
  the recording stopped taking data and why; the ``END`` frame closes a
  recording that was finished properly, with its counts.

Why frames of their own and not the journal's SQLite file: a recording is read
front to back at a candidate's pace and must be readable up to where it is
damaged (a truncated copy, a flipped byte); a sequence of checksummed frames
gives both, and each frame decodes alone, so a reader of one stream skips the
others' bodies without decompressing them.  The entries themselves are the
journal's, so the player applies them through the same Session methods.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import time
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator

import zstandard

from twinstep._version import PROTOCOL_VERSION, __version__
from twinstep.server.journal.entries import Entry, Kind
from twinstep.v1 import twinstep_pb2 as pb

MAGIC = b"TWREC\r\n\x1a"  # \r\n catches newline translation, \x1a stops a text dump (as PNG's signature does)
FORMAT_VERSION = 1
"""Readers read every version up to theirs and refuse a newer one (docs/recording.md: compatibility)."""
SUFFIX = ".twrec"

_FILE_HEAD = struct.Struct("<8sHHI")
_FRAME = struct.Struct("<BBHIqIII")  # type, kind, flags, stream, step, body length, body crc32, header crc32
_CRC = struct.Struct("<I")
_BODY_HEAD = struct.Struct("<I")  # the entry's header length, then header, then payload

ENTRY, NOTE, END = 1, 2, 3
"""Frame types (stored: never renumber).  A reader skips types it does not know."""
COMPRESSED, HAS_PAYLOAD = 1, 2
"""Frame flags."""
MAX_FRAME_BYTES = 1 << 31
"""A body length above this is damage, not data (a piece is at most 4 MiB, a step's records far less)."""
_MAX_DESCRIPTION = 1 << 20
_LEVEL = 3  # 2.5x on the demo's statistics; float32 tensors 1.08x at ~500 MB/s of one core (benchmarks/recording.py)
_PRECOMPRESSED_CODECS = frozenset({pb.ZSTD, pb.QUANT_ZSTD})  # compressing these again gains nothing
_PIECE_CODEC = pb.TensorPiece.DESCRIPTOR.fields_by_name["codec"].number
_STEP_FIELD = {Kind.PIECE: pb.TensorPiece.DESCRIPTOR.fields_by_name["step"].number,
               Kind.STEP: pb.StepRecords.DESCRIPTOR.fields_by_name["step"].number}
_KINDS = frozenset(int(kind) for kind in Kind)


class RecordingError(ValueError):
    """A recording cannot be read (further): the message says which file, where, and what to do."""

    def __init__(self, message: str, offset: int = 0) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass(frozen=True)
class Description:
    """What the file header says about a recording."""

    path: pathlib.Path
    session: str
    created: float
    version: int
    twinstep: str
    protocol: int
    data_offset: int
    """Where the first frame starts."""


@dataclass(frozen=True)
class FrameHead:
    type: int
    kind: int
    stream: int
    step: int
    """The step of a STEP or PIECE entry, -1 for other frames."""
    flags: int
    """COMPRESSED, HAS_PAYLOAD."""
    offset: int
    """Byte offset of the frame in the file."""


@dataclass(frozen=True)
class Frame:
    head: FrameHead
    entry: Entry | None = None
    """An ENTRY frame's entry (seq: the frame's number in the file, from 1)."""
    note: dict | None = None
    """A NOTE or END frame's JSON."""


# -- writing -----------------------------------------------------------------------------------------


class RecordingWriter:
    """Appends frames to one new recording file (one writer thread; not thread-safe)."""

    def __init__(self, path: str | pathlib.Path, session: str, created: float | None = None) -> None:
        self.path = pathlib.Path(path)
        description = json.dumps({"session": session, "created": created or time.time(), "twinstep": __version__,
                                  "protocol": PROTOCOL_VERSION}).encode()
        head = _FILE_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(description)) + description
        self._file: BinaryIO = open(self.path, "xb")
        self._file.write(head + _CRC.pack(zlib.crc32(head)))
        self.size = len(head) + _CRC.size
        self._compressor = zstandard.ZstdCompressor(level=_LEVEL)

    def encode_entry(self, kind: int, stream: int, header: bytes, payload: bytes | memoryview | None) -> bytes:
        """One ENTRY frame, ready to write (done before writing, so its size can be checked against a budget)."""
        body = _BODY_HEAD.pack(len(header)) + bytes(header) + (bytes(payload) if payload is not None else b"")
        flags = HAS_PAYLOAD if payload is not None else 0
        step = entry_step(kind, header)
        if not (kind == Kind.PIECE and wire_int(header, _PIECE_CODEC, 0) in _PRECOMPRESSED_CODECS):
            packed = self._compressor.compress(body)
            if len(packed) < len(body):
                body, flags = packed, flags | COMPRESSED
        return _frame(ENTRY, int(kind), flags, stream, step, body)

    def encode_note(self, note: dict, final: bool = False) -> bytes:
        return _frame(END if final else NOTE, 0, 0, 0, -1, json.dumps(note).encode())

    def write(self, frame: bytes) -> int:
        self._file.write(frame)
        self.size += len(frame)
        return len(frame)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _frame(type_: int, kind: int, flags: int, stream: int, step: int, body: bytes) -> bytes:
    head = _FRAME.pack(type_, kind, flags, stream, step, len(body), zlib.crc32(body), 0)[:-_CRC.size]
    return head + _CRC.pack(zlib.crc32(head)) + body


def entry_step(kind: int, header: bytes | memoryview) -> int:
    """The step a STEP or PIECE entry belongs to (-1 for other kinds), read off its serialized header."""
    field = _STEP_FIELD.get(kind)
    return -1 if field is None else wire_int(header, field, 0)  # proto3 leaves a 0 out


def wire_int(message: bytes | memoryview, field: int, default: int = -1) -> int:
    """A top-level varint field of a serialized protobuf message, without parsing the rest (a step's records
    are most of a recording's bytes; their step number is one varint among them)."""
    data = memoryview(message)
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                value, pos = _varint(data, pos)
                if number == field:
                    return value - (1 << 64) if value >= 1 << 63 else value
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                pos += length
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            else:
                return default
    except IndexError:
        return default
    return default


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


# -- reading -----------------------------------------------------------------------------------------


def describe(path: str | pathlib.Path) -> Description:
    """The file header of a recording; RecordingError when it is none, or one of a newer format."""
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            return _read_description(f, path)
    except OSError as exc:
        raise RecordingError(f"cannot read the recording {path}: {exc.strerror or exc}") from None


def _read_description(f: BinaryIO, path: pathlib.Path) -> Description:
    head = f.read(_FILE_HEAD.size)
    if len(head) < _FILE_HEAD.size or head[:len(MAGIC)] != MAGIC:
        raise RecordingError(f"{path} is not a twinstep recording (it does not start with the recording "
                             "signature); pass a file written by `twinstep serve --record`")
    _, version, _, length = _FILE_HEAD.unpack(head)
    if version > FORMAT_VERSION:
        raise RecordingError(f"{path} has recording format {version}, written by a newer twinstep; this one reads "
                             f"formats up to {FORMAT_VERSION} (upgrade twinstep to read it)")
    if length > _MAX_DESCRIPTION:
        raise RecordingError(f"{path}: the recording's header is damaged (a description of {length} bytes)")
    text = f.read(length)
    crc = f.read(_CRC.size)
    if len(text) < length or len(crc) < _CRC.size:
        raise RecordingError(f"{path} is truncated inside its header ({_FILE_HEAD.size + len(text)} bytes): "
                             "nothing was recorded in it")
    if _CRC.unpack(crc)[0] != zlib.crc32(head + text):
        raise RecordingError(f"{path}: the recording's header is corrupt (checksum mismatch)")
    try:
        info = json.loads(text)
        return Description(path, str(info["session"]), float(info["created"]), version, str(info.get("twinstep", "")),
                           int(info.get("protocol", 0)), _FILE_HEAD.size + length + _CRC.size)
    except (ValueError, KeyError, TypeError) as exc:
        raise RecordingError(f"{path}: the recording's header is unreadable ({exc})") from None


class RecordingReader:
    """Reads one recording front to back, a frame at a time (memory: one frame)."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        try:
            self._file: BinaryIO = open(self.path, "rb")
        except OSError as exc:
            raise RecordingError(f"cannot read the recording {self.path}: {exc.strerror or exc}") from None
        try:
            self.description = _read_description(self._file, self.path)
            self._size = os.fstat(self._file.fileno()).st_size
        except BaseException:
            self._file.close()
            raise
        self._decompressor = zstandard.ZstdDecompressor()
        self.position = self.description.data_offset
        """Where the next frame starts: after an error, how far the file was read."""
        self.ended = False
        """The END frame was read: the recording was finished properly."""

    def __enter__(self) -> "RecordingReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def frames(self, want: Callable[[FrameHead], bool] | None = None) -> Iterator[Frame]:
        """Every frame in order, or those ``want`` accepts (the others' bodies are skipped, not checked).

        Raises RecordingError at the first frame that is truncated or damaged; what was yielded before
        it is intact (each frame carries its own checksum).
        """
        f, number = self._file, 0
        f.seek(self.position)
        while True:
            offset = self.position
            raw = f.read(_FRAME.size)
            if not raw:
                return
            number += 1
            if len(raw) < _FRAME.size:
                raise self._truncated(offset, number)
            type_, kind, flags, stream, step, length, crc, head_crc = _FRAME.unpack(raw)
            if zlib.crc32(raw[:-_CRC.size]) != head_crc or length > MAX_FRAME_BYTES:
                raise RecordingError(f"{self.path} is corrupt at byte {offset} (frame {number}): its frame header "
                                     "is damaged (checksum mismatch); the frames before it were read", offset)
            if offset + _FRAME.size + length > self._size:
                raise self._truncated(offset, number)
            head = FrameHead(type_, kind, stream, step, flags, offset)
            if type_ == ENTRY and (kind not in _KINDS or (want is not None and not want(head))):
                # Skipped unread (its header is intact): another stream's frame, or an entry kind a newer
                # twinstep added (skipped as a whole, like an unknown frame type).
                f.seek(length, os.SEEK_CUR)
                self.position = offset + _FRAME.size + length
                continue
            body = f.read(length)
            if len(body) < length:
                raise self._truncated(offset, number)
            if zlib.crc32(body) != crc:
                raise RecordingError(f"{self.path} is corrupt at byte {offset} (frame {number}): checksum mismatch "
                                     "(the file was damaged after it was written); the frames before it were read",
                                     offset)
            self.position = offset + _FRAME.size + length
            if type_ == ENTRY:
                yield Frame(head, entry=self._entry(body, flags, kind, stream, number, offset))
            elif type_ in (NOTE, END):
                if type_ == END:
                    self.ended = True
                try:
                    note = json.loads(body)
                except ValueError:
                    note = {}
                yield Frame(head, note=note if isinstance(note, dict) else {})
            # Other types: written by a newer twinstep for readers that know them; skipped here.

    def _entry(self, body: bytes, flags: int, kind: int, stream: int, number: int, offset: int) -> Entry:
        try:
            if flags & COMPRESSED:
                body = self._decompressor.decompress(body, max_output_size=MAX_FRAME_BYTES)
            (length,) = _BODY_HEAD.unpack_from(body)
            if _BODY_HEAD.size + length > len(body):
                raise ValueError("entry header longer than its frame")
            header = body[_BODY_HEAD.size:_BODY_HEAD.size + length]
            payload = body[_BODY_HEAD.size + length:] if flags & HAS_PAYLOAD else None
            return Entry(number, Kind(kind), stream, header, payload)
        except (zstandard.ZstdError, ValueError, struct.error) as exc:
            raise RecordingError(f"{self.path} is corrupt at byte {offset} (frame {number}): its entry cannot be "
                                 f"decoded ({exc}); the frames before it were read", offset) from None

    def _truncated(self, offset: int, number: int) -> RecordingError:
        return RecordingError(f"{self.path} is truncated at byte {self._size} (frame {number}, from byte {offset}, is "
                              "incomplete): the recording was cut short (a copy that did not finish, a full disk, or "
                              "a server that is still writing it); the frames before it were read", offset)


def recordings_in(directory: str | pathlib.Path) -> list[pathlib.Path]:
    """The recording files of a directory (by name; their headers are not read)."""
    directory = pathlib.Path(directory)
    try:
        return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
    except OSError:
        return []
