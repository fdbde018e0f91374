"""Tensor payload codec shared by client and server: lossless, and tolerance-aware lossy.

Lossless (``RAW``, ``ZSTD``): tensors travel as little-endian C-order bytes,
zstandard-compressed.  bfloat16 has no numpy dtype, so it travels as its raw
16-bit pattern and is widened to float32 on decode.  Decoding checks sizes
before allocating, so a corrupt or hostile payload raises ``PayloadError``
instead of exhausting memory.

Lossy (``QUANT_ZSTD``, float32/float16/bfloat16 only)
-----------------------------------------------------
Lossless float compression is weak (zstd ~1.1x on float32), but a comparison
only needs errors far below its tolerance.  Each element x becomes the integer
code ``q = round(x / step)`` and decodes to ``float32(q * step)`` (product in
float64).  ``step = 2 * error_bound * (1 - s)``, where
``s = min(1/4, 2**-24 * (abs_max + error_bound) / error_bound)`` leaves room for
the float32 rounding of decoded values, so ``|x - decoded| <= error_bound``.
The encoder decodes every element itself and sends as an *exception*, with its
exact float32 value, any element that is NaN/Inf, whose code has
``|q| >= 2**31``, or whose decoding still misses the bound (a bound below a
quarter of the value's float32 resolution; exact ties).  Hence, for every
element: finite ones decode within ``error_bound``; NaN/Inf decode exactly
(bit-exact for float32 inputs, exact widening for 16-bit ones); -0.0 decodes as
+0.0.  Decoded tensors are always float32.

``data`` layout, little-endian::

    header, 24 bytes, not compressed:
        magic b"TQ", version u8 = 1, width u8 in {1, 2, 4}, flags u8
        (bit 0: codes byte-shuffled), 3 zero bytes,
        offset i64 (the code stored as 0), n_exceptions u64
    one zstandard frame of:
        codes    numel x width bytes: q - offset as unsigned ints (0 at
                 exceptions); when shuffled, byte plane 0 of all codes, then 1, ...
        indices  n_exceptions x u32, strictly increasing
        values   n_exceptions x float32 bit patterns

``raw_nbytes`` stays the storage size of the original tensor (so ``decode``
checks it as for lossless payloads); ``quant_step`` and ``error_bound`` travel
in ``TensorPiece``.  Limits, which the decoder enforces before allocating:
``width <= itemsize`` of the original dtype and ``n_exceptions <= numel // 8``,
so the frame decompresses to at most ``raw_nbytes + numel`` bytes.  Where they
would be broken (or the dtype is not a 16/32-bit float, or the bound is 0)
``encode_quantized`` falls back to lossless ``ZSTD`` for that tensor.
On the demo model's float32 activations (tolerance 1e-4, margin 0.1) zstd makes
1.38x of plain codes, 1.76x of byte-shuffled ones, 1.71x of shuffled zigzag
deltas (neighbours are not correlated): hence shuffled, no delta.

Choosing the bound (each run quantizes its own tensor)
-------------------------------------------------------
Let a (baseline) and b (candidate) be the compared tensors over their n common
finite elements, each quantized with ``delta = eps * rms`` of itself, so the
errors satisfy ``||e_a|| <= delta_a * sqrt(n) = eps ||a||`` and
``||e_b|| <= eps ||b|| <= eps (1 + r) ||a||``.  Worst cases, not expectations:

* rel_l2 ``r = ||a - b|| / ||a||``; by the triangle inequality
  ``(r (1 - eps) - 2 eps) / (1 + eps) <= r' <= (r (1 + eps) + 2 eps) / (1 - eps)``.
  Both bounds are reached (errors of +-delta aligned with a - b and a).  The
  verdict ``r > tol`` is unchanged whenever ``|r - tol| > m tol`` iff
  ``eps <= m tol / (2 + (2 + m) tol)`` (about ``m tol / 2``): ``error_bound_for``.
* cosine gap ``g = 1 - cos(theta)``: ``||e|| <= eps ||x||`` turns x by at most
  ``asin(eps)``, so ``|theta' - theta| <= 2 asin(eps)``.  With
  ``theta(g) = 2 asin(sqrt(g / 2))`` the verdict is kept outside the margin if
  ``2 asin(eps) <= min(theta(tol) - theta(tol (1 - m)), theta(min(tol (1 + m), 2)) - theta(tol))``:
  ``error_bound_for_cosine``.
* max_abs ``max |a - b|`` moves by at most ``delta_a + delta_b``: ``delta = m tol / 2``
  (absolute, the same on both sides): ``error_bound_for_max_abs``.

``lossy_budget`` takes the smallest of the three for a record's tolerances, as a
fraction of the rms capped by an absolute bound, and ``error_bound`` applies it
to one tensor's rms (the server sends the budget, the client applies it).  The statistics metrics (rms, mean, extrema, nonfinite) come from
the exact tensor on the client and are not affected.  The rms must be that of
the finite elements (as ``stats.rms``); if the candidate has non-finite values
where the baseline does not, fewer elements are compared and the bound can be
exceeded, but the ``nonfinite`` metric (tolerance 0) already fails that record.
A client's rms (float32 cascade sums, ~1e-7 relative error) shifts the margin
by as much.  The bound follows the configured tolerance: a server that
tightens it (noise bands) keeps the guarantee only for the configured one.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

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
#: zstandard level of every payload: level 1 keeps up with a fast link on one core; higher levels gain little on floats.
ZSTD_LEVEL = 1

#: Share of the tolerance the lossy stream may move a metric by (see module docstring).
DEFAULT_MARGIN = 0.1
_LOSSY_DTYPES = ("float32", "float16", "bfloat16")
_QUANT_HEADER = struct.Struct("<2sBBB3sqQ")
_QUANT_MAGIC = b"TQ"
_QUANT_VERSION = 1
_SHUFFLED = 1
_MAX_SHRINK = 0.25  # of the step, for float32 rounding; beyond, elements become exceptions
_CODE_LIMIT = 1 << 31  # |code| must stay below: codes fit int32, offsets and ranges uint32
_EXCEPTION_SHARE = 8  # at most numel // 8 exceptions, else lossless
_CHUNK = 1 << 16  # elements per pass: float64 buffers of 512 KiB stay in cache


class PayloadError(ValueError):
    """A tensor payload that cannot be decoded as announced."""


def storage_dtype(dtype: str) -> np.dtype:
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise PayloadError(f"unsupported dtype {dtype!r}; known: {sorted(_STORAGE)}") from None


def little_endian(raw: np.ndarray) -> np.ndarray:
    """``raw`` as a C-contiguous little-endian array; copies only when it is not one already."""
    buf = np.ascontiguousarray(raw)
    if buf.dtype.byteorder == ">":
        buf = buf.byteswap().view(buf.dtype.newbyteorder("<"))
    return buf


def encode(raw: np.ndarray, compress: bool = True) -> tuple[int, bytes, int]:
    """Encode the storage array of a tensor; returns (codec, data, raw_nbytes).

    ``raw`` must already be in storage form (bfloat16 as uint16), any layout.
    """
    data = little_endian(raw).tobytes()
    if not compress:
        return pb.RAW, data, len(data)
    return pb.ZSTD, zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data), len(data)


# -- error bounds ------------------------------------------------------------------


def _bound_inputs_ok(tolerance: float, margin: float) -> bool:
    if not 0.0 < margin < 1.0:
        raise ValueError(f"margin must be in (0, 1), got {margin}")
    if math.isnan(tolerance) or tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    return tolerance > 0


def error_bound_for(rms: float, tolerance: float, margin: float = DEFAULT_MARGIN) -> float:
    """Per-element bound keeping the rel_l2 verdict wherever |rel_l2 - tol| > margin * tol.

    ``rms`` is that of the tensor being encoded (its finite elements).  Returns 0
    (send losslessly) for a zero or non-finite rms or a zero tolerance, inf for an
    infinite tolerance.  Derivation in the module docstring.
    """
    if not _bound_inputs_ok(tolerance, margin) or not (math.isfinite(rms) and rms > 0):
        return 0.0
    if math.isinf(tolerance):
        return math.inf
    return rms * margin * tolerance / (2.0 + (2.0 + margin) * tolerance)


def error_bound_for_cosine(rms: float, tolerance: float, margin: float = DEFAULT_MARGIN) -> float:
    """Per-element bound keeping the cosine-gap verdict wherever |gap - tol| > margin * tol."""
    if not _bound_inputs_ok(tolerance, margin) or not (math.isfinite(rms) and rms > 0):
        return 0.0
    if tolerance >= 2.0:  # the gap never exceeds 2
        return math.inf

    def angle(gap: float) -> float:
        return 2.0 * math.asin(math.sqrt(gap / 2.0))

    room = angle(tolerance) - angle(tolerance * (1.0 - margin))
    if tolerance * (1.0 + margin) < 2.0:
        room = min(room, angle(tolerance * (1.0 + margin)) - angle(tolerance))
    return rms * math.sin(room / 2.0)


def error_bound_for_max_abs(tolerance: float, margin: float = DEFAULT_MARGIN) -> float:
    """Per-element bound keeping the max_abs verdict wherever |max_abs - tol| > margin * tol."""
    if not _bound_inputs_ok(tolerance, margin):
        return 0.0
    return margin * tolerance / 2.0


def lossy_budget(tolerances: Mapping[str, float], margin: float = DEFAULT_MARGIN) -> tuple[float, float]:
    """(rms_fraction, absolute): the budget of the element-wise tolerances (rel_l2, cosine, max_abs).

    What the server tells lossy clients (``LossyBound``, one per phase, for the
    tightest tolerances a record of it can be judged by); a tensor's own bound
    follows from its rms with :func:`error_bound`.  Missing metrics count as
    never checked.
    """
    inf = math.inf
    fraction = min(error_bound_for(1.0, tolerances.get("rel_l2", inf), margin),
                   error_bound_for_cosine(1.0, tolerances.get("cosine", inf), margin))
    return fraction, error_bound_for_max_abs(tolerances.get("max_abs", inf), margin)


def error_bound(rms: float, rms_fraction: float, absolute: float) -> float:
    """Per-element bound of one tensor under a :func:`lossy_budget`: the smallest of the three metrics' bounds.

    ``rms`` is that of the tensor's finite elements.  0 (send losslessly) for a
    zero or non-finite rms; inf when no element-wise metric is checked.  Both
    bounds of rel_l2 and cosine are proportional to the rms, so a fraction of
    it is exact.
    """
    if not (math.isfinite(rms) and rms > 0):
        return 0.0
    return min(rms_fraction * rms, absolute)


# -- lossy encoding ----------------------------------------------------------------


def _dtype_name(store: np.dtype) -> str:
    """Dtype name of a storage array; uint16 can only be bfloat16 bits."""
    for name, dt in _STORAGE.items():
        if dt == store.newbyteorder("<"):
            return name
    raise ValueError(f"no wire dtype is stored as {store}")


def _finite_abs_max(flat: np.ndarray, dtype: str) -> float:
    """Largest finite magnitude of a storage array (0 when there is none)."""
    if dtype == "bfloat16":
        magnitude = flat & np.uint16(0x7FFF)
        top = int(magnitude.max(where=magnitude < 0x7F80, initial=0))  # 0x7F80 and up: Inf, NaN
        return float(np.array([top << 16], dtype=np.uint32).view(np.float32)[0])
    lo, hi = float(flat.min(initial=0)), float(flat.max(initial=0))
    if math.isfinite(lo) and math.isfinite(hi):
        return max(-lo, hi)
    return float(np.abs(flat[np.isfinite(flat)]).max(initial=0))


def _float32_bits(chunk: np.ndarray, dtype: str) -> np.ndarray:
    """Exact float32 bit patterns of storage elements (NaN payloads kept for float32)."""
    if dtype == "bfloat16":
        return chunk.astype(np.uint32) << 16
    if dtype == "float16":
        return chunk.astype(np.float32).view(np.uint32)
    return chunk.view(np.uint32)


def encode_quantized(
    values: np.ndarray, error_bound: float, dtype: str | None = None
) -> tuple[int, bytes, int, float]:
    """Encode a storage array so each element decodes within ``error_bound``.

    Returns (codec, data, raw_nbytes, quant_step).  ``dtype`` defaults to the one
    stored as ``values.dtype`` (uint16 = bfloat16).  Falls back to lossless ``ZSTD``
    (quant_step 0) where lossy cannot apply; see the module docstring.
    """
    raw = little_endian(values)
    dtype = dtype or _dtype_name(raw.dtype)
    if raw.dtype != storage_dtype(dtype):
        raise ValueError(f"values stored as {raw.dtype} are not the storage of {dtype} ({storage_dtype(dtype)})")
    bound = float(error_bound)
    if not (math.isfinite(bound) and bound >= 0):
        raise ValueError(f"error_bound must be finite and >= 0, got {error_bound}")
    flat = raw.reshape(-1)
    numel = flat.size
    if dtype not in _LOSSY_DTYPES or bound == 0 or numel >= 1 << 32:
        return (*encode(raw), 0.0)
    # Leave room for the float32 rounding of decoded values (<= 2**-24 of their
    # magnitude), so that no element misses the bound by it; each miss would cost an
    # 8-byte exception (0.5% of N(0, 1) elements at tolerance 1e-4 with step = 2 bound).
    step = 2.0 * bound * (1.0 - min(_MAX_SHRINK, (_finite_abs_max(flat, dtype) + bound) * 2.0**-24 / bound))
    codes = np.empty(numel, dtype=np.int32)
    bad_index: list[np.ndarray] = []
    bad_value: list[np.ndarray] = []
    n_bad, lo, hi = 0, math.inf, -math.inf
    # Preallocated float64 buffers, reused per cache-sized chunk: ~5x faster than temporaries.
    x, q, r = (np.empty(min(numel, _CHUNK)) for _ in range(3))
    ok, close = (np.empty(min(numel, _CHUNK), dtype=bool) for _ in range(2))
    for start in range(0, numel, _CHUNK):
        part = flat[start : start + _CHUNK]
        n = part.size
        x_, q_, r_, ok_, close_ = x[:n], q[:n], r[:n], ok[:n], close[:n]
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            np.copyto(x_, (part.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else part)
            np.divide(x_, step, out=q_)
            np.rint(q_, out=q_)
            np.less(np.abs(q_, out=r_), _CODE_LIMIT, out=ok_)  # False for NaN and Inf
            if not ok_.all():
                q_[~ok_] = 0.0
            # Exactly what decode computes (there q is offset + stored, exact in float64).
            np.multiply(q_, step, out=r_)
            np.subtract(r_.astype(np.float32), x_, out=r_)
            np.less_equal(np.abs(r_, out=r_), bound, out=close_)
            ok_ &= close_
        if ok_.all():
            lo, hi = min(lo, float(q_.min())), max(hi, float(q_.max()))
        else:
            bad = np.flatnonzero(~ok_)
            n_bad += bad.size
            if n_bad > numel // _EXCEPTION_SHARE:
                return (*encode(raw), 0.0)
            bad_index.append(bad + start)
            bad_value.append(_float32_bits(part[bad], dtype))
            lo = min(lo, float(q_.min(where=ok_, initial=math.inf)))
            hi = max(hi, float(q_.max(where=ok_, initial=-math.inf)))
        codes[start : start + n] = q_
    offset = int(lo) if n_bad < numel else 0
    span = int(hi) - offset if n_bad < numel else 0
    width = 1 if span < 1 << 8 else 2 if span < 1 << 16 else 4
    if width > raw.itemsize:
        return (*encode(raw), 0.0)
    index = np.concatenate(bad_index) if bad_index else np.zeros(0, dtype=np.int64)
    codes[index] = offset
    stored = codes.view(np.uint32)
    np.subtract(stored, np.uint32(offset % (1 << 32)), out=stored)  # in place, modulo 2**32
    stored = stored.astype(f"<u{width}", copy=False)
    flags = _SHUFFLED if width > 1 else 0
    exact = np.concatenate(bad_value) if bad_value else np.zeros(0, np.uint32)
    header = _QUANT_HEADER.pack(_QUANT_MAGIC, _QUANT_VERSION, width, flags, bytes(3), offset, n_bad)
    # One frame, fed in parts to spare a copy of the codes.
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=numel * width + 8 * n_bad)
    parts = [header]
    parts.append(frame.compress(stored.view(np.uint8).reshape(numel, width).T.tobytes() if flags else stored))
    parts.append(frame.compress(index.astype("<u4").tobytes() + exact.astype("<u4").tobytes()))
    parts.append(frame.flush())
    return pb.QUANT_ZSTD, b"".join(parts), raw.nbytes, step


# -- decoding ----------------------------------------------------------------------


def _decompress(data: bytes | memoryview, expected: int) -> bytes:
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
    return raw


def decode(
    codec: int,
    data: bytes,
    raw_nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    *,
    quant_step: float = 0.0,
    error_bound: float = 0.0,
) -> np.ndarray:
    """Decode a payload to a numpy array of the given shape.

    bfloat16 is widened to float32, and ``QUANT_ZSTD`` payloads always decode to
    float32.  ``quant_step`` (required for ``QUANT_ZSTD``) and ``error_bound`` (0 =
    not given; else checked against the step) are the ``TensorPiece`` fields.
    """
    store = storage_dtype(dtype)
    numel = math.prod(shape)
    expected = numel * store.itemsize
    if raw_nbytes != expected:
        raise PayloadError(f"payload announces {raw_nbytes} bytes, shape {list(shape)} of {dtype} needs {expected}")
    if expected > MAX_RAW_NBYTES:
        raise PayloadError(f"payload of {expected} bytes exceeds the limit of {MAX_RAW_NBYTES}")
    if codec == pb.QUANT_ZSTD:
        return _decode_quantized(data, dtype, shape, numel, quant_step, error_bound)
    if codec == pb.RAW:
        raw = data
    elif codec == pb.ZSTD:
        raw = _decompress(data, expected)
    else:
        raise PayloadError(f"unknown codec {codec}")
    if len(raw) != expected:
        raise PayloadError(f"payload decompressed to {len(raw)} bytes, expected {expected}")
    array = np.frombuffer(raw, dtype=store)
    if dtype == "bfloat16":
        # Viewed while 1-D: numpy 1.x cannot change the item size of a 0-d array (a bfloat16 loss).
        return (array.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return array.reshape(shape)


def decode_storage(codec: int, data: bytes | memoryview, raw_nbytes: int, dtype: str, numel: int) -> np.ndarray:
    """A lossless payload as its flat storage array, bit for bit (bfloat16 stays its uint16 pattern).

    For values that are loaded rather than compared (weight sync): ``decode``
    widens bfloat16, which would change a model's dtype.  Read-only when RAW.
    """
    store = storage_dtype(dtype)
    expected = numel * store.itemsize
    if raw_nbytes != expected:
        raise PayloadError(f"payload announces {raw_nbytes} bytes, {numel} elements of {dtype} need {expected}")
    if codec == pb.RAW:
        raw = data
    elif codec == pb.ZSTD:
        raw = _decompress(data, expected)
    else:
        raise PayloadError(f"codec {codec} is not lossless (RAW or ZSTD)")
    if len(raw) != expected:
        raise PayloadError(f"payload holds {len(raw)} bytes, expected {expected}")
    return np.frombuffer(raw, dtype=store)


def _decode_quantized(
    data: bytes, dtype: str, shape: tuple[int, ...], numel: int, quant_step: float, error_bound: float
) -> np.ndarray:
    if dtype not in _LOSSY_DTYPES:
        raise PayloadError(f"QUANT_ZSTD payload of {dtype}: only {', '.join(_LOSSY_DTYPES)} are quantized")
    step = float(quant_step)
    if not (math.isfinite(step) and step > 0):
        raise PayloadError(f"QUANT_ZSTD payload needs a finite quant_step > 0, got {quant_step}")
    if error_bound and step > float(error_bound) * 2.0:
        raise PayloadError(f"quant_step {step} exceeds twice error_bound {error_bound}")
    if len(data) < _QUANT_HEADER.size:
        raise PayloadError(f"QUANT_ZSTD payload of {len(data)} bytes is shorter than its header")
    magic, version, width, flags, reserved, offset, n_bad = _QUANT_HEADER.unpack_from(data)
    if magic != _QUANT_MAGIC or version != _QUANT_VERSION or reserved != bytes(3):
        raise PayloadError(f"QUANT_ZSTD header: bad magic {magic!r}, version {version} or reserved bytes")
    if width not in (1, 2, 4) or width > storage_dtype(dtype).itemsize:
        raise PayloadError(f"QUANT_ZSTD header: code width {width} invalid for {dtype}")
    if flags & ~_SHUFFLED:
        raise PayloadError(f"QUANT_ZSTD header: unknown flags {flags:#x}")
    if not -_CODE_LIMIT <= offset < _CODE_LIMIT:
        raise PayloadError(f"QUANT_ZSTD header: offset {offset} out of range")
    if n_bad > numel // _EXCEPTION_SHARE:
        limit = numel // _EXCEPTION_SHARE
        raise PayloadError(f"QUANT_ZSTD header: {n_bad} exceptions for {numel} elements (limit {limit})")
    body = _decompress(memoryview(data)[_QUANT_HEADER.size :], numel * width + 8 * n_bad)
    end = numel * width
    if flags & _SHUFFLED:
        stored = np.frombuffer(body, np.uint8, count=end).reshape(width, numel).T.copy().view(f"<u{width}")
    else:
        stored = np.frombuffer(body, f"<u{width}", count=numel)
    stored = stored.reshape(-1)
    index = np.frombuffer(body, "<u4", count=n_bad, offset=end)
    bits = np.frombuffer(body, "<u4", count=n_bad, offset=end + 4 * n_bad)
    if n_bad and (int(index[-1]) >= numel or np.any(np.diff(index.astype(np.int64)) <= 0)):
        raise PayloadError("QUANT_ZSTD exception indices are not strictly increasing below numel")
    out = np.empty(numel, dtype=np.float32)
    buf = np.empty(min(numel, _CHUNK))
    with np.errstate(over="ignore"):  # a hostile code may exceed float32: it decodes to inf
        for start in range(0, numel, _CHUNK):
            part = stored[start : start + _CHUNK]
            b = buf[: part.size]
            np.add(part, float(offset), out=b)
            np.multiply(b, step, out=b)
            out[start : start + part.size] = b
    out.view(np.uint32)[index] = bits
    return out.reshape(shape)
