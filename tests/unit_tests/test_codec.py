"""twinstep.wire.codec: lossless and lossy round trips, error bounds, and refusal of bad payloads."""

from __future__ import annotations

import math
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import zstandard

from twinstep.wire import codec
from twinstep.server.compare import metrics
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.v1 import twinstep_pb2 as pb

NUMPY_DTYPES = ["float32", "float16", "int8", "int16", "int32", "int64", "uint8", "bool", "float64"]


def _sample(dtype: str, shape=(5, 7), seed=3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) > 0.5
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    x = rng.normal(0, 100, size=shape).astype(dtype)
    x.flat[0] = -0.0
    if x.size > 3:
        x.flat[1] = np.inf
        x.flat[2] = np.nan
    return x


def _same(a: np.ndarray, b: np.ndarray) -> None:
    """Bit-for-bit equality (NaN payloads and signed zeros included)."""
    assert a.shape == b.shape
    assert a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_round_trip(dtype, compress):
    x = _sample(dtype)
    kind, data, raw_nbytes = codec.encode(x, compress=compress)
    assert kind == (pb.ZSTD if compress else pb.RAW)
    assert raw_nbytes == x.nbytes
    y = codec.decode(kind, data, raw_nbytes, dtype, x.shape)
    assert y.dtype == codec.storage_dtype(dtype)
    _same(np.ascontiguousarray(x).astype(y.dtype), y)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES + ["bfloat16"])
def test_empty_round_trip(dtype):
    store = codec.storage_dtype(dtype)
    x = np.zeros((0, 3), dtype=store)
    kind, data, raw_nbytes = codec.encode(x)
    assert raw_nbytes == 0
    y = codec.decode(kind, data, raw_nbytes, dtype, (0, 3))
    assert y.shape == (0, 3)


def test_non_contiguous_round_trip():
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    for view in (base.T, base[::2, 1::3], base[:, ::-1]):
        assert not view.flags["C_CONTIGUOUS"]
        kind, data, n = codec.encode(view)
        y = codec.decode(kind, data, n, "float32", view.shape)
        np.testing.assert_array_equal(y, view)


def test_big_endian_input_travels_little_endian():
    x = np.array([1.5, -2.0, 3.25], dtype=">f4")
    kind, data, n = codec.encode(x, compress=False)
    assert data == np.array([1.5, -2.0, 3.25], dtype="<f4").tobytes()
    np.testing.assert_array_equal(codec.decode(kind, data, n, "float32", (3,)), x.astype("<f4"))


def test_zero_dim_round_trip():
    x = np.array(2.5, dtype=np.float64)
    kind, data, n = codec.encode(x)
    y = codec.decode(kind, data, n, "float64", ())
    assert y.shape == () and y == 2.5


def test_bfloat16_bits_widen_to_float32():
    # Values with at most 8 significant bits are exact in bfloat16.
    values = np.array([1.0, -2.5, 0.15625, 1.5 * 2.0**120, -(2.0**-130), np.inf, -0.0], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    assert np.all((values.view(np.uint32) & 0xFFFF) == 0)  # the test data really is bfloat16
    kind, data, n = codec.encode(bits)
    y = codec.decode(kind, data, n, "bfloat16", values.shape)
    assert y.dtype == np.float32
    _same(values, y)


# -- through the capture backends ------------------------------------------------


def _backend(name):
    pytest.importorskip(name)
    if name == "torch":
        from twinstep.runtime.capture.torch import TorchBackend

        return TorchBackend()
    from twinstep.runtime.capture.paddle import PaddleBackend

    return PaddleBackend()


def _through_backend(backend, tensor):
    dtype, shape = backend.describe(tensor)
    raw = backend.storage_array(backend.host_copy(tensor)[0])
    kind, data, n = codec.encode(raw)
    return codec.decode(kind, data, n, dtype, shape)


TORCH_DTYPES = ["float32", "float16", "bfloat16", "int8", "int32", "int64", "uint8", "bool", "float64"]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_backend_round_trip(dtype):
    torch = pytest.importorskip("torch")
    backend = _backend("torch")
    x = torch.from_numpy(np.random.default_rng(1).normal(0, 50, size=(6, 5)))
    t = (x > 0) if dtype == "bool" else x.to(getattr(torch, dtype))
    y = _through_backend(backend, t)
    assert y.shape == (6, 5)
    if dtype == "bfloat16":
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, t.float().numpy())
    else:
        assert y.dtype == t.numpy().dtype
        np.testing.assert_array_equal(y, t.numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_torch_backend_non_contiguous_and_empty(dtype):
    torch = pytest.importorskip("torch")
    backend = _backend("torch")
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6).to(getattr(torch, dtype))
    t = base.t()
    assert not t.is_contiguous()
    y = _through_backend(backend, t)
    np.testing.assert_array_equal(y, t.to(torch.float64).numpy())
    assert y.shape == (6, 4)
    sliced = base[:, ::2]
    np.testing.assert_array_equal(_through_backend(backend, sliced), sliced.to(torch.float64).numpy())
    empty = torch.zeros((0, 5), dtype=getattr(torch, dtype))
    assert _through_backend(backend, empty).shape == (0, 5)


def test_torch_host_copy_is_private():
    torch = pytest.importorskip("torch")
    backend = _backend("torch")
    t = torch.ones(4)
    copy, _ = backend.host_copy(t)
    t.add_(1.0)
    np.testing.assert_array_equal(backend.storage_array(copy), np.ones(4, dtype=np.float32))


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_paddle_backend_round_trip(dtype):
    paddle = pytest.importorskip("paddle")
    backend = _backend("paddle")
    x = np.random.default_rng(2).normal(0, 50, size=(6, 5))
    t = paddle.to_tensor(x > 0) if dtype == "bool" else paddle.to_tensor(x).astype(dtype)
    y = _through_backend(backend, t)
    assert y.shape == (6, 5)
    if dtype == "bfloat16":
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, t.astype("float32").numpy())
    else:
        np.testing.assert_array_equal(y, t.numpy())
        assert y.dtype == t.numpy().dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_paddle_backend_transposed_and_empty(dtype):
    paddle = pytest.importorskip("paddle")
    backend = _backend("paddle")
    base = paddle.arange(24, dtype="float64").reshape([4, 6]).astype(dtype)
    t = paddle.transpose(base, [1, 0])
    y = _through_backend(backend, t)
    assert y.shape == (6, 4)
    np.testing.assert_array_equal(y, base.astype("float64").numpy().T)
    empty = paddle.zeros([0, 5], dtype=dtype)
    assert _through_backend(backend, empty).shape == (0, 5)


# -- refusals -------------------------------------------------------------------


def _payload(x: np.ndarray, compress=True):
    return codec.encode(x, compress=compress)


def test_wrong_raw_nbytes():
    x = np.arange(10, dtype=np.int32)
    kind, data, n = _payload(x)
    with pytest.raises(codec.PayloadError, match="announces 36 bytes"):
        codec.decode(kind, data, n - 4, "int32", (10,))
    # Right byte count but the wrong shape for it
    with pytest.raises(codec.PayloadError):
        codec.decode(kind, data, n, "int32", (11,))
    # Right raw_nbytes for the shape but a dtype of another width
    with pytest.raises(codec.PayloadError):
        codec.decode(kind, data, n, "int64", (10,))


def test_corrupt_zstd_bytes():
    x = np.arange(1000, dtype=np.int64)
    kind, data, n = _payload(x)
    with pytest.raises(codec.PayloadError, match="zstd"):
        codec.decode(kind, b"not a zstd frame at all", n, "int64", (1000,))
    flipped = bytearray(data)
    flipped[0] ^= 0xFF  # magic number
    with pytest.raises(codec.PayloadError):
        codec.decode(kind, bytes(flipped), n, "int64", (1000,))


@pytest.mark.parametrize("compress", [True, False])
def test_truncated_data(compress):
    x = np.random.default_rng(0).normal(size=500)
    kind, data, n = _payload(x, compress=compress)
    with pytest.raises(codec.PayloadError):
        codec.decode(kind, data[: len(data) // 2], n, "float64", (500,))
    with pytest.raises(codec.PayloadError):
        codec.decode(kind, data[:-1], n, "float64", (500,))


def test_raw_payload_too_long():
    x = np.arange(8, dtype=np.uint8)
    kind, data, n = _payload(x, compress=False)
    with pytest.raises(codec.PayloadError):
        codec.decode(kind, data + b"\0", n, "uint8", (8,))


def test_frame_decompressing_to_more_than_announced():
    x = np.zeros(1000, dtype=np.float32)
    kind, data, _ = _payload(x)
    with pytest.raises(codec.PayloadError):
        codec.decode(kind, data, 400, "float32", (100,))


@pytest.mark.parametrize("kind", [pb.CODEC_UNSPECIFIED, 7])
def test_unknown_codec(kind):
    x = np.arange(4, dtype=np.float32)
    _, data, n = _payload(x, compress=False)
    with pytest.raises(codec.PayloadError, match="unknown codec"):
        codec.decode(kind, data, n, "float32", (4,))


@pytest.mark.parametrize("dtype", ["complex64", "float8", "", "uint16"])
def test_unknown_dtype(dtype):
    with pytest.raises(codec.PayloadError, match="unsupported dtype"):
        codec.decode(pb.RAW, b"\0" * 8, 8, dtype, (2,))
    with pytest.raises(codec.PayloadError):
        codec.storage_dtype(dtype)


def test_wire_dtype_tables_are_inverse_and_complete():
    assert set(codec.DTYPE_TO_WIRE) == set(codec._STORAGE)
    for name, wire in codec.DTYPE_TO_WIRE.items():
        assert codec.WIRE_TO_DTYPE[wire] == name
    assert len(codec.WIRE_TO_DTYPE) == len(codec.DTYPE_TO_WIRE)


def test_announced_size_over_limit_refused_before_allocating():
    numel = codec.MAX_RAW_NBYTES // 8 + 1
    shape = (numel,)
    raw_nbytes = numel * 8
    assert raw_nbytes > codec.MAX_RAW_NBYTES
    tiny = zstandard.ZstdCompressor().compress(b"\0" * 8)
    tracemalloc.start()
    try:
        for kind, data in ((pb.ZSTD, tiny), (pb.RAW, b"")):
            with pytest.raises(codec.PayloadError, match="exceeds the limit"):
                codec.decode(kind, data, raw_nbytes, "float64", shape)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decode allocated {peak} bytes before refusing"


def test_limit_is_inclusive():
    # A payload of exactly MAX_RAW_NBYTES passes the size check (then fails on the bytes given).
    numel = codec.MAX_RAW_NBYTES
    with pytest.raises(codec.PayloadError, match="decompressed to 0 bytes"):
        codec.decode(pb.RAW, b"", numel, "uint8", (numel,))


@pytest.mark.parametrize("content_size", [False, True], ids=["no-size-in-header", "size-in-header"])
def test_a_small_payload_cannot_expand_beyond_its_announcement(content_size):
    # zstandard ignores max_output_size when the frame header states a content size,
    # so a tiny payload announcing 16 bytes must not make decode allocate 32 MiB.
    big = zstandard.ZstdCompressor(level=1, write_content_size=content_size).compress(b"\0" * (32 << 20))
    assert len(big) < 1 << 16
    tracemalloc.start()
    try:
        with pytest.raises(codec.PayloadError):
            codec.decode(pb.ZSTD, big, 16, "uint8", (16,))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decode allocated {peak} bytes for a 16-byte payload"


def test_shape_product_overflow_is_not_wrapped():
    # Python ints do not wrap: an absurd shape is refused by size, not accepted as small.
    shape = (1 << 40, 1 << 40)
    assert math.prod(shape) * 4 > codec.MAX_RAW_NBYTES
    with pytest.raises(codec.PayloadError):
        codec.decode(pb.RAW, b"", 16, "float32", shape)


# -- lossy: QUANT_ZSTD ------------------------------------------------------------

LOSSY_DTYPES = ["float32", "float16", "bfloat16"]


def _to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """Storage array of float values in a dtype (bfloat16: round to nearest even, as uint16 bits)."""
    if dtype != "bfloat16":
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as a cast on the device
            return np.asarray(x, dtype=dtype)
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def _exact(storage: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values of a storage array."""
    if dtype == "bfloat16":
        return (storage.astype(np.uint32).reshape(-1) << 16).view(np.float32).astype(np.float64).reshape(storage.shape)
    return storage.astype(np.float64)


def _lossy(storage: np.ndarray, dtype: str, bound: float) -> tuple[int, bytes, np.ndarray]:
    """Encode, decode, and check the codec's promise element by element."""
    kind, data, n, step = codec.encode_quantized(storage, bound, dtype)
    assert n == storage.size * codec.storage_dtype(dtype).itemsize
    if kind == pb.QUANT_ZSTD:
        assert 0.75 * 2 * bound <= step <= 2 * bound
    else:
        assert kind == pb.ZSTD and step == 0.0
    y = codec.decode(kind, data, n, dtype, storage.shape, quant_step=step, error_bound=bound)
    assert y.shape == storage.shape
    x = _exact(storage, dtype)
    if kind == pb.QUANT_ZSTD:
        assert y.dtype == np.float32
    y64 = y.astype(np.float64)
    finite = np.isfinite(x)
    assert np.all(np.abs(y64[finite] - x[finite]) <= bound)
    # Non-finite values survive exactly (same NaN positions, same infinities).
    np.testing.assert_array_equal(np.isnan(y64), np.isnan(x))
    np.testing.assert_array_equal(y64[np.isinf(x)], x[np.isinf(x)])
    return kind, data, y


def _header(data: bytes) -> tuple:
    return struct.unpack_from("<2sBBB3sqQ", data)


@pytest.mark.parametrize("dtype", LOSSY_DTYPES)
@pytest.mark.parametrize(
    "case",
    ["normal", "offset", "tiny", "constant", "zeros", "wide", "heavy_tail", "grid_ties"],
)
def test_lossy_round_trip_within_bound(dtype, case):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    n = 20_000
    bound = 1e-3
    if case == "normal":
        x = rng.normal(0, 1, n)
    elif case == "offset":  # LayerNorm weights: a large common value, small spread
        x = 1000.0 + rng.normal(0, 1, n)
    elif case == "tiny":  # far below the bound: everything quantizes to 0
        x, bound = rng.normal(0, 1e-6, n), 1e-3
    elif case == "constant":
        x = np.full(n, 3.7)
    elif case == "zeros":
        x = np.zeros(n)
        x[::2] = -0.0
    elif case == "wide":  # 1e-3 .. 1e6: 32-bit codes, float32 rounding above the bound for the largest
        top = 6e4 if dtype == "float16" else 1e6
        x = np.exp(rng.uniform(np.log(1e-3), np.log(top), n)) * rng.choice([-1, 1], n)
        bound = 1e-2
    elif case == "heavy_tail":
        x = rng.standard_cauchy(n)
    else:  # values exactly halfway between codes, where rounding ties
        bound = 2.0**-8
        x = (rng.integers(-100, 100, n) + 0.5) * 2 * bound
    storage = _to_storage(x, dtype)
    kind, _, y = _lossy(storage, dtype, bound)
    if case in ("normal", "tiny", "constant", "zeros", "grid_ties"):
        assert kind == pb.QUANT_ZSTD
    if case in ("tiny", "zeros"):
        assert np.all(y == 0.0)
    if case == "constant":
        assert _header(_lossy(storage, dtype, bound)[1])[2] == 1  # one-byte codes


@pytest.mark.parametrize("dtype", LOSSY_DTYPES)
def test_lossy_non_finite_and_overflowing_codes_survive_exactly(dtype):
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, 10_000).astype(np.float32)
    # Codes of |x| / (2 bound) >= 2**31 overflow; float16 cannot hold such values next
    # to 16-bit codes of the others.
    bound, big = {"float32": (1e-6, 6e4), "bfloat16": (1e-4, 2.0**40), "float16": (1e-2, None)}[dtype]
    specials = {3: np.nan, 17: np.inf, 18: -np.inf, 9_999: np.nan}
    if big:
        specials.update({400: big, 401: -big})
    for i, v in specials.items():
        x[i] = v
    storage = _to_storage(x, dtype)
    if dtype == "float32":
        storage.view(np.uint32)[9_999] = 0x7FC01234  # a NaN payload, which float32 keeps bit for bit
    kind, data, y = _lossy(storage, dtype, bound)
    assert kind == pb.QUANT_ZSTD
    assert _header(data)[6] >= len(specials)
    if big:
        assert y[400] == np.float32(big) and y[401] == np.float32(-big)
    if dtype == "float32":
        assert y.view(np.uint32)[9_999] == 0x7FC01234


def test_lossy_exceptions_are_exact_float32_bits():
    x = np.array([np.nan, 1.0, np.inf, -np.inf, 2.5, 3e38, -3e38] + [0.25] * 100, dtype=np.float32)
    kind, data, n, step = codec.encode_quantized(x, 1e-3)
    assert kind == pb.QUANT_ZSTD
    y = codec.decode(kind, data, n, "float32", x.shape, quant_step=step)
    nonfinite = ~np.isfinite(x) | (np.abs(x) > 1e38)
    _same(x[nonfinite], y[nonfinite])


@pytest.mark.parametrize("dtype", LOSSY_DTYPES)
def test_lossy_empty_and_zero_dim(dtype):
    store = codec.storage_dtype(dtype)
    for shape in ((0, 3), ()):
        storage = np.zeros(shape, dtype=store) + (np.ones(shape, dtype=store) if shape == () else 0)
        kind, data, n, step = codec.encode_quantized(storage, 0.1, dtype)
        y = codec.decode(kind, data, n, dtype, shape, quant_step=step)
        assert y.shape == shape
        np.testing.assert_allclose(y, _exact(storage, dtype), atol=0.1)


def test_lossy_non_contiguous_and_big_endian():
    base = np.random.default_rng(1).normal(size=(60, 50)).astype(np.float32)
    for view in (base.T, base[::2, 1::3], base.astype(">f4")):
        kind, data, n, step = codec.encode_quantized(view, 1e-3)
        assert kind == pb.QUANT_ZSTD
        y = codec.decode(kind, data, n, "float32", view.shape, quant_step=step)
        assert np.abs(y - view.astype(np.float32)).max() <= 1e-3


def test_lossy_beats_lossless_and_narrows_codes():
    x = np.random.default_rng(2).normal(size=1 << 16).astype(np.float32)
    lossless = len(codec.encode(x)[1])
    bound = codec.error_bound_for(1.0, 1e-4)
    kind, data, _, _ = codec.encode_quantized(x, bound)
    assert kind == pb.QUANT_ZSTD and len(data) < 0.7 * lossless
    # A loose bound needs only one-byte codes (a quarter of the float32 bytes, before zstd).
    kind, data, _, _ = codec.encode_quantized(x, 0.05)
    assert _header(data)[2] == 1 and len(data) < x.nbytes / 5


def test_lossy_falls_back_to_lossless():
    rng = np.random.default_rng(3)
    for x in (np.arange(100, dtype=np.int32), rng.normal(size=100), np.zeros(50, dtype=bool)):
        kind, data, n, step = codec.encode_quantized(x, 0.1)  # not a 16/32-bit float
        assert (kind, step) == (pb.ZSTD, 0.0)
        _same(x, codec.decode(kind, data, n, codec._dtype_name(x.dtype), x.shape))
    x = rng.normal(size=1000).astype(np.float32)
    kind, data, n, step = codec.encode_quantized(x, 0.0)  # a zero bound means lossless
    assert kind == pb.ZSTD
    _same(x, codec.decode(kind, data, n, "float32", x.shape))
    x[:200] = np.nan  # more than 1/8 exceptions
    assert codec.encode_quantized(x, 0.1)[0] == pb.ZSTD
    # 16-bit input that would need 32-bit codes
    h = np.linspace(-6e4, 6e4, 1000).astype(np.float16)
    kind, data, n, _ = codec.encode_quantized(h, 1e-3)
    assert kind == pb.ZSTD
    _same(h, codec.decode(kind, data, n, "float16", h.shape))


def test_lossy_refuses_bad_arguments():
    x = np.ones(10, dtype=np.float32)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="error_bound"):
            codec.encode_quantized(x, bad)
    with pytest.raises(ValueError, match="not the storage of bfloat16"):
        codec.encode_quantized(x, 0.1, "bfloat16")
    with pytest.raises(ValueError, match="no wire dtype"):
        codec.encode_quantized(np.ones(3, dtype=np.complex64), 0.1)


def test_lossy_through_torch_backend_bfloat16():
    torch = pytest.importorskip("torch")
    backend = _backend("torch")
    t = torch.from_numpy(np.random.default_rng(4).normal(0, 3, size=(64, 33))).to(torch.bfloat16).t()
    dtype, shape = backend.describe(t)
    raw = backend.storage_array(backend.host_copy(t)[0])
    kind, data, n, step = codec.encode_quantized(raw, 0.01)
    assert kind == pb.QUANT_ZSTD and n == t.numel() * 2
    y = codec.decode(kind, data, n, dtype, shape, quant_step=step, error_bound=0.01)
    assert y.dtype == np.float32 and y.shape == (33, 64)
    assert np.abs(y - t.float().numpy()).max() <= 0.01


# -- lossy: refusals -------------------------------------------------------------


def _quant_payload(width=2, flags=1, offset=0, n_bad=0, codes=None, index=(), bits=(), numel=100,
                   magic=b"TQ", version=1, reserved=bytes(3), extra=b""):
    """Hand-built QUANT_ZSTD data, to say exactly what is wrong with it."""
    codes = bytes(numel * width) if codes is None else codes
    body = codes + np.asarray(index, dtype="<u4").tobytes() + np.asarray(bits, dtype="<u4").tobytes() + extra
    header = struct.pack("<2sBBB3sqQ", magic, version, width, flags, reserved, offset, n_bad)
    return header + zstandard.ZstdCompressor().compress(body)


def test_hand_built_payload_decodes():
    # Guards the helper: a well-formed hand-built payload decodes as the format says.
    codes = np.arange(100, dtype="<u2").tobytes()
    bits = np.float32([np.inf, 9]).view(np.uint32)
    data = _quant_payload(flags=0, offset=-50, n_bad=2, codes=codes, index=[3, 7], bits=bits)
    y = codec.decode(pb.QUANT_ZSTD, data, 400, "float32", (100,), quant_step=0.5)
    expected = (np.arange(100) - 50) * 0.5
    expected[3], expected[7] = np.inf, 9.0
    np.testing.assert_array_equal(y, expected.astype(np.float32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(magic=b"XX"), "magic"),
        (dict(version=2), "version"),
        (dict(reserved=b"\0\0\1"), "reserved"),
        (dict(width=3), "width"),
        (dict(width=8), "width"),
        (dict(flags=2), "flags"),
        (dict(offset=1 << 31), "offset"),
        (dict(offset=-(1 << 31) - 1), "offset"),
        (dict(n_bad=13, index=range(13), bits=[0] * 13), "exceptions"),
        (dict(n_bad=(1 << 64) - 1), "exceptions"),
        (dict(n_bad=2, index=[5, 5], bits=[0, 0]), "strictly increasing"),
        (dict(n_bad=2, index=[7, 5], bits=[0, 0]), "strictly increasing"),
        (dict(n_bad=1, index=[100], bits=[0]), "below numel"),
        (dict(n_bad=2, index=[1], bits=[0]), "decompressed to"),
        (dict(extra=b"\0"), "decompressed to"),
        (dict(codes=bytes(199)), "decompressed to"),
    ],
)
def test_quantized_header_and_body_refused(kwargs, match):
    data = _quant_payload(**kwargs)
    with pytest.raises(codec.PayloadError, match=match):
        codec.decode(pb.QUANT_ZSTD, data, 400, "float32", (100,), quant_step=0.1)


def test_quantized_width_wider_than_dtype_refused():
    data = _quant_payload(width=4, numel=100)
    with pytest.raises(codec.PayloadError, match="width 4 invalid for bfloat16"):
        codec.decode(pb.QUANT_ZSTD, data, 200, "bfloat16", (100,), quant_step=0.1)


@pytest.mark.parametrize("step", [0.0, -1.0, math.nan, math.inf])
def test_quantized_needs_a_valid_step(step):
    data = _quant_payload()
    with pytest.raises(codec.PayloadError, match="quant_step"):
        codec.decode(pb.QUANT_ZSTD, data, 400, "float32", (100,), quant_step=step)


def test_quantized_step_larger_than_bound_allows_refused():
    x = np.random.default_rng(0).normal(size=100).astype(np.float32)
    kind, data, n, step = codec.encode_quantized(x, 0.01)
    with pytest.raises(codec.PayloadError, match="exceeds twice error_bound"):
        codec.decode(kind, data, n, "float32", (100,), quant_step=step, error_bound=0.001)


@pytest.mark.parametrize("dtype", ["float64", "int32", "bool"])
def test_quantized_only_for_16_32_bit_floats(dtype):
    store = codec.storage_dtype(dtype)
    with pytest.raises(codec.PayloadError, match="only float32"):
        codec.decode(pb.QUANT_ZSTD, _quant_payload(width=1), 100 * store.itemsize, dtype, (100,), quant_step=0.1)


def test_quantized_corrupt_and_truncated():
    x = np.random.default_rng(0).normal(size=5000).astype(np.float32)
    kind, data, n, step = codec.encode_quantized(x, 1e-4)
    for bad in (data[:10], data[:24], data[: len(data) // 2], data[:-1], data[:24] + b"not zstd at all"):
        with pytest.raises(codec.PayloadError):
            codec.decode(kind, bad, n, "float32", x.shape, quant_step=step)
    flipped = bytearray(data)
    flipped[24] ^= 0xFF  # zstd magic number
    with pytest.raises(codec.PayloadError, match="zstd"):
        codec.decode(kind, bytes(flipped), n, "float32", x.shape, quant_step=step)
    with pytest.raises(codec.PayloadError, match="announces"):
        codec.decode(kind, data, n - 4, "float32", x.shape, quant_step=step)


def test_quantized_small_payload_cannot_expand():
    # A frame of 32 MiB of zeros behind a header announcing 16 one-byte codes.
    bomb = struct.pack("<2sBBB3sqQ", b"TQ", 1, 1, 0, bytes(3), 0, 0) + zstandard.ZstdCompressor(level=1).compress(
        b"\0" * (32 << 20)
    )
    assert len(bomb) < 1 << 16
    tracemalloc.start()
    try:
        with pytest.raises(codec.PayloadError):
            codec.decode(pb.QUANT_ZSTD, bomb, 64, "float32", (16,), quant_step=0.1)
        # Huge exception count: refused from the header, before any allocation.
        with pytest.raises(codec.PayloadError, match="exceptions"):
            codec.decode(pb.QUANT_ZSTD, _quant_payload(n_bad=1 << 40, numel=16, width=1), 64, "float32", (16,),
                         quant_step=0.1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decode allocated {peak} bytes for a 16-element payload"


def test_quantized_hostile_codes_decode_to_inf_not_crash():
    data = _quant_payload(width=4, flags=0, offset=(1 << 31) - 1, codes=b"\xff" * 400)
    y = codec.decode(pb.QUANT_ZSTD, data, 400, "float32", (100,), quant_step=1e30)
    assert np.all(np.isposinf(y))


# -- lossy: error bounds and the verdicts they keep -----------------------------


def test_error_bound_edges():
    assert codec.error_bound_for(2.0, 1e-4, 0.1) == pytest.approx(2.0 * 0.1 * 1e-4 / 2, rel=2e-4)
    assert codec.error_bound_for(0.0, 1e-4) == 0.0
    assert codec.error_bound_for(math.nan, 1e-4) == 0.0
    assert codec.error_bound_for(math.inf, 1e-4) == 0.0
    assert codec.error_bound_for(1.0, 0.0) == 0.0
    assert codec.error_bound_for(1.0, math.inf) == math.inf
    assert codec.error_bound_for_cosine(1.0, 2.0) == math.inf
    assert codec.error_bound_for_max_abs(1e-3, 0.1) == pytest.approx(5e-5)
    for margin in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="margin"):
            codec.error_bound_for(1.0, 1e-4, margin)
    with pytest.raises(ValueError, match="tolerance"):
        codec.error_bound_for_cosine(1.0, -1.0)
    # float32 activation defaults: rel_l2 at 1e-4 binds, not cosine at 1e-6 (an angle of 1.4e-3) ...
    tolerances = {"rel_l2": 1e-4, "cosine": 1e-6, "max_abs": math.inf}
    def bound(rms, tolerances):
        return codec.error_bound(rms, *codec.lossy_budget(tolerances))

    assert bound(3.0, tolerances) == pytest.approx(codec.error_bound_for(3.0, 1e-4), rel=1e-14)
    # ... while a loose rel_l2 leaves cosine binding (bfloat16 activations: 0.2 and 0.01).
    assert bound(3.0, {"rel_l2": 0.2, "cosine": 0.01}) == pytest.approx(codec.error_bound_for_cosine(3.0, 0.01),
                                                                         rel=1e-14)
    assert bound(3.0, dict(tolerances, max_abs=1e-9)) == pytest.approx(5e-11)
    assert bound(3.0, {}) == math.inf
    assert bound(0.0, tolerances) == bound(math.nan, tolerances) == 0.0  # nothing to scale by: lossless


def _signs(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice([-1.0, 1.0], size=n)


@pytest.mark.parametrize("margin", [0.1, 0.3])
@pytest.mark.parametrize("tol", [1e-4, 1e-3, 0.05, 0.5])
def test_rel_l2_bound_holds_at_the_worst_case(tol, margin):
    # a has constant magnitude and b = (1 + r) a, so errors of +-delta on every element
    # can line up with both a and a - b: the triangle-inequality bounds are reached.
    n, c = 4096, 3.0
    t = _signs(n, 0) * c
    kappa = codec.error_bound_for(1.0, tol, margin)

    def worst(r: float, up: bool) -> float:
        a, b = t, (1 + r) * t
        d_a, d_b = kappa * c, kappa * c * (1 + r)  # each side's own rms
        s = -1.0 if up else 1.0
        return metrics.from_tensors(a + s * d_a * np.sign(t), b - s * d_b * np.sign(t))["rel_l2"]

    below, above = tol * (1 - margin) * (1 - 1e-9), tol * (1 + margin) * (1 + 1e-9)
    assert worst(below, up=True) <= tol
    assert worst(above, up=False) > tol
    # The bound is tight: half-way into the margin, the worst case flips the verdict.
    assert worst(tol * (1 - margin / 2), up=True) > tol
    assert worst(tol * (1 + margin / 2), up=False) <= tol


@pytest.mark.parametrize("margin", [0.1, 0.3])
@pytest.mark.parametrize("tol", [1e-6, 1e-5, 5e-4, 0.05])
def test_cosine_bound_holds_against_rotations(tol, margin):
    n = 4096
    t1 = np.ones(n)
    t2 = np.tile([1.0, -1.0], n // 2)  # orthogonal to t1, same norm
    delta = codec.error_bound_for_cosine(1.0, tol, margin)

    def perturbed(gap: float, widen: bool) -> float:
        theta = 2 * math.asin(math.sqrt(gap / 2))
        a, b = t1, math.cos(theta) * t1 + math.sin(theta) * t2  # both of rms 1
        s = 1.0 if widen else -1.0  # turn each vector away from (or towards) the other
        return metrics.from_tensors(a - s * delta * t2, b + s * delta * t2)["cosine"]

    assert perturbed(tol * (1 - margin) * (1 - 1e-6), widen=True) <= tol
    assert perturbed(tol * (1 + margin) * (1 + 1e-6), widen=False) > tol
    assert perturbed(tol * (1 - margin / 2), widen=True) > tol  # the bound is not vacuous


def _pair(rng, n: int, r: float, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """a and b with rel_l2(a, b) = r exactly (in float64)."""
    if kind == "normal":
        a = rng.normal(0, 1, n)
    elif kind == "offset":
        a = 1.0 + 0.01 * rng.normal(0, 1, n)
    elif kind == "sparse":  # embedding gradients: mostly zeros
        a = rng.normal(0, 1, n) * (rng.random(n) < 0.05)
    else:
        a = rng.standard_t(2, n)
    d = rng.normal(0, 1, n) * (rng.random(n) < 0.5 if kind == "sparse" else 1)
    return a, a + d * (r * np.linalg.norm(a) / np.linalg.norm(d))


@pytest.mark.parametrize("kind", ["normal", "offset", "sparse", "heavy"])
@pytest.mark.parametrize("dtype, phase", [("float32", "forward"), ("float32", "param"), ("bfloat16", "grad")])
def test_lossy_verdicts_match_lossless_outside_the_margin(dtype, phase, kind):
    tolerances = dict(ToleranceConfig().for_record(phase, "m", dtype))
    tolerances["max_abs"] = 0.02
    m = codec.DEFAULT_MARGIN
    rng = np.random.default_rng(zlib.crc32(f"{dtype} {phase} {kind}".encode()))
    tol = tolerances["rel_l2"]
    ratios = np.concatenate([[1 - m, 1 + m], np.linspace(0.7, 1.3, 25)])
    checked = {"rel_l2": 0, "cosine": 0, "max_abs": 0}
    for ratio in ratios:
        for nudge in (1 - 1e-3, 1 + 1e-3):
            a, b = _pair(rng, 2048, tol * ratio * nudge, kind)
            sa, sb = _to_storage(a, dtype), _to_storage(b, dtype)
            ea, eb = _exact(sa, dtype), _exact(sb, dtype)  # what the lossless stream carries
            decoded = []
            for s, e in ((sa, ea), (sb, eb)):
                bound = codec.error_bound(float(np.sqrt(np.mean(e * e))), *codec.lossy_budget(tolerances, m))
                decoded.append(_lossy(s, dtype, bound)[2])
            exact, lossy = metrics.from_tensors(ea, eb), metrics.from_tensors(*decoded)
            for metric in checked:
                limit = tolerances[metric]
                if abs(exact[metric] - limit) > m * limit:
                    checked[metric] += 1
                    assert (lossy[metric] > limit) == (exact[metric] > limit), (metric, exact, lossy)
            # ... and within the worst-case perturbation of the docstring.
            r, eps = exact["rel_l2"], m * tol / (2 + (2 + m) * tol)
            assert (r * (1 - eps) - 2 * eps) / (1 + eps) <= lossy["rel_l2"] <= (r * (1 + eps) + 2 * eps) / (1 - eps)
    assert checked["rel_l2"] >= 30  # most pairs sit outside the margin, on both sides


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("compress", [False, True])
def test_a_zero_dim_tensor_round_trips_losslessly(dtype, compress):
    """A loss is 0-d; numpy 1.x cannot re-view a 0-d array as another item size (bfloat16 -> float32)."""
    storage = _to_storage(np.array([2.75]), dtype).reshape(())
    kind, data, raw = codec.encode(storage, compress=compress)
    y = codec.decode(kind, data, raw, dtype, ())
    assert y.shape == () and float(y) == 2.75
