"""twinstep.codec: lossless round trips and refusal of bad payloads."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import zstandard

from twinstep import codec
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
        from twinstep.capture.torch import TorchBackend

        return TorchBackend()
    from twinstep.capture.paddle import PaddleBackend

    return PaddleBackend()


def _through_backend(backend, tensor):
    dtype, shape = backend.describe(tensor)
    raw = backend.storage_array(backend.host_copy(tensor))
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
    copy = backend.host_copy(t)
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
