"""Lossless tensor payload codec shared by client and server.

Tensors travel as little-endian C-order bytes, zstandard-compressed.  bfloat16
has no numpy dtype, so it travels as its raw 16-bit pattern and is widened to
float32 on decode.  Decoding checks sizes before allocating, so a corrupt or
hostile payload raises ``PayloadError`` instead of exhausting memory.
"""

from __future__ import annotations

import math

import numpy as np
import zstandard

from twinstep.v1 import twinstep_pb2 as pb

#: Framework-neutral dtype names -> wire enum.
DTYPE_TO_WIRE: dict[str, int] = {
    "float32": pb.FLOAT32,
    "float16": pb.FLOAT16,
    "bfloat16": pb.BFLOAT16,
    "float64": pb.FLOAT64,
    "int8": pb.INT8,
    "int16": pb.INT16,
    "int32": pb.INT32,
    "int64": pb.INT64,
    "uint8": pb.UINT8,
    "bool": pb.BOOL,
}
WIRE_TO_DTYPE: dict[int, str] = {v: k for k, v in DTYPE_TO_WIRE.items()}

# How each dtype is stored on the wire (bfloat16 as its bit pattern).
_STORAGE = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float64": np.dtype("<f8"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

#: Largest tensor the server will decode (bytes, uncompressed).
MAX_RAW_NBYTES = 1 << 31
_ZSTD_LEVEL = 1


class PayloadError(ValueError):
    """A tensor payload that cannot be decoded as announced."""


def storage_dtype(dtype: str) -> np.dtype:
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise PayloadError(f"unsupported dtype {dtype!r}; known: {sorted(_STORAGE)}") from None


def encode(raw: np.ndarray, compress: bool = True) -> tuple[int, bytes, int]:
    """Encode the storage array of a tensor; returns (codec, data, raw_nbytes).

    ``raw`` must already be in storage form (bfloat16 as uint16), any layout.
    """
    buf = np.ascontiguousarray(raw)
    if buf.dtype.byteorder == ">":
        buf = buf.byteswap().view(buf.dtype.newbyteorder("<"))
    data = buf.tobytes()
    if not compress:
        return pb.RAW, data, len(data)
    return pb.ZSTD, zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(data), len(data)


def decode(codec: int, data: bytes, raw_nbytes: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a payload to a numpy array of the given shape (bfloat16 widened to float32)."""
    store = storage_dtype(dtype)
    numel = math.prod(shape)
    expected = numel * store.itemsize
    if raw_nbytes != expected:
        raise PayloadError(f"payload announces {raw_nbytes} bytes, shape {list(shape)} of {dtype} needs {expected}")
    if expected > MAX_RAW_NBYTES:
        raise PayloadError(f"payload of {expected} bytes exceeds the limit of {MAX_RAW_NBYTES}")
    if codec == pb.RAW:
        raw = data
    elif codec == pb.ZSTD:
        try:
            # Read at most one byte past the announced size: a frame header claiming
            # more (max_output_size is ignored when the header states a size) cannot
            # make us allocate it.
            with zstandard.ZstdDecompressor().stream_reader(data) as reader:
                raw = reader.read(expected + 1)
        except zstandard.ZstdError as exc:
            raise PayloadError(f"corrupt zstd payload: {exc}") from None
        if len(raw) != expected:
            raise PayloadError(f"corrupt zstd payload: decompressed to {len(raw)} bytes, expected {expected}")
    else:
        raise PayloadError(f"unknown codec {codec}")
    if len(raw) != expected:
        raise PayloadError(f"payload decompressed to {len(raw)} bytes, expected {expected}")
    array = np.frombuffer(raw, dtype=store).reshape(shape)
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array
