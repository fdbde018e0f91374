"""Count-sketches of tensor shards keyed by the element's index in the logical tensor.

Each shard of a logical tensor -- any rectangular block, in the tensor's stored
layout -- is sketched with every element hashed by its global canonical index,
so the shards' sketches add up to the sketch of the whole tensor (a sketch is
linear).  Checked on the numpy reference (``sketch_array(..., block=...)``) and
on the torch and paddle device sketchers, through both device paths for a block
that is not one contiguous range: the cached element table and the indices
hashed on the device (forced here with ``max_table_elements=0``).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from twinstep.runtime.capture.torch.sketch import TorchSketcher
from twinstep.wire import sketch
from twinstep.wire.sketch import SketchSpec

os.environ.setdefault("OMP_NUM_THREADS", "1")
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle

from twinstep.runtime.capture.paddle.sketch import PaddleSketcher  # noqa: E402

# MindSpore is not imported beside torch and paddle: in the legs that have it, it cannot share their process
# (its protobuf files, the oldest leg's numpy), so its sketcher's blocks are not exercised here.

RNG_SEED = 20240612
SPEC = SketchSpec()
FRAMEWORKS = ["torch", "paddle"]
#: Device sums in float32 bags (~64 elements each) before float64: the same bound as the
#: device-vs-reference tests of test_sketch.py; float64 tensors stay float64 throughout.
REL = {np.float32: 1e-6, np.float64: 1e-12}


def _rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def _close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    """Equal up to ``rel`` of the sketch's scale (buckets are sums: compare to their rms)."""
    scale = max(float(np.sqrt(np.mean(np.square(want)))), 1e-300)
    np.testing.assert_array_less(np.abs(got - want), rel * scale + 1e-300)


def _cuts(size: int, parts: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of consecutive pieces of the given sizes (which sum to ``size``)."""
    assert sum(parts) == size
    edges = np.cumsum([0, *parts])
    return [(int(a), int(b)) for a, b in zip(edges, edges[1:])]


def _shards(shape: tuple[int, ...], splits: dict[int, list[int]]) -> list[tuple[tuple[slice, ...], tuple[int, ...]]]:
    """Every block of a grid: splits maps a dimension to its piece sizes (uneven allowed)."""
    per_dim = [_cuts(n, splits.get(d, [n])) for d, n in enumerate(shape)]
    blocks = [((), ())]
    for pieces in per_dim:
        blocks = [(sl + (slice(a, b),), off + (a,)) for sl, off in blocks for a, b in pieces]
    return blocks


#: name -> (stored global shape, {dim: piece sizes}, transpose)
LAYOUTS = {
    "rows (dim 0)": ((300, 200), {0: [100, 137, 63]}, False),
    "columns (dim 1)": ((300, 200), {1: [64, 100, 36]}, False),
    "activation, last dim": ((4, 50, 96), {2: [32, 40, 24]}, False),
    "activation, sequence dim": ((4, 50, 96), {1: [25, 13, 12]}, False),
    "both dims": ((300, 200), {0: [150, 101, 49], 1: [77, 123]}, False),
    "[in, out] weight, split on in": ((200, 120), {0: [100, 60, 40]}, True),
    "[in, out] weight, split on out": ((200, 120), {1: [64, 56]}, True),
    "[in, out] weight, both dims": ((200, 120), {0: [120, 80], 1: [30, 90]}, True),
    # Shards larger than a float32 bag's span and than the element-by-element limit.
    "large, last dim": ((256, 1024), {1: [512, 300, 212]}, False),
    "whole tensor": ((30, 20), {}, False),
    "vector": ((1000,), {0: [1, 599, 400]}, False),
    "scalar": ((), {}, False),
}


def _sketcher(framework: str, **kwargs):
    if framework == "torch":
        return TorchSketcher(SPEC, **kwargs), torch.from_numpy
    return PaddleSketcher(SPEC, **kwargs), paddle.to_tensor


def _device_sketch(sketcher, to_tensor, array: np.ndarray, **kwargs) -> np.ndarray:
    out = sketcher.sketch(to_tensor(np.array(array, order="C")), **kwargs)  # keeps a 0-d array 0-d
    return sketcher.to_host([out])[0]


# -- block_indices: the definition -------------------------------------------------------


def _canonical_indices(global_shape: tuple[int, ...], transpose: bool) -> np.ndarray:
    """An array of the stored global shape holding each element's canonical flat index."""
    if transpose:
        rows, cols = global_shape
        return np.arange(rows * cols).reshape(cols, rows).T
    return np.arange(int(np.prod(global_shape))).reshape(global_shape)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_block_indices_are_the_canonical_global_indices_in_canonical_local_order(name):
    shape, splits, transpose = LAYOUTS[name]
    index_of = _canonical_indices(shape, transpose)
    seen = []
    for slices, offsets in _shards(shape, splits):
        local = index_of[slices]
        got = sketch.block_indices(local.shape, shape, offsets, transpose)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, sketch.canonical_flat(local, transpose))
        seen.append(got)
    # The shards cover the logical tensor exactly once.
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(index_of.size))


def test_block_indices_of_a_transposed_block_index_the_transposed_tensor():
    # Stored [in=3, out=4]; canonical [out=4, in=3]: stored (a, b) is canonical b*3 + a.
    got = sketch.block_indices((2, 2), (3, 4), (1, 2), transpose=True)
    # Canonical local order is local.T: (b=2,a=1), (b=2,a=2), (b=3,a=1), (b=3,a=2).
    np.testing.assert_array_equal(got, [7, 8, 10, 11])


@pytest.mark.parametrize("args, message", [
    (((2, 3), (4,), (0, 0)), "same number of dimensions"),
    (((2, 3), (4, 3), (0,)), "same number of dimensions"),
    (((2, 3), (4, 3), (3, 0)), "outside"),
    (((2, 3), (4, 3), (0, 1)), "outside"),
    (((2, 3), (4, 3), (-1, 0)), "negative"),
    (((2, -3), (4, 3), (0, 0)), "negative"),
])
def test_block_indices_validate_their_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        sketch.block_indices(*args)


def test_block_transpose_needs_a_matrix():
    with pytest.raises(ValueError, match="2-D"):
        sketch.block_indices((2, 3, 4), (2, 3, 8), (0, 0, 4), transpose=True)


def test_contiguous_blocks_are_recognised():
    # Leading dims of one element, then one partial dim, then whole dims: one range.
    assert sketch.block_offset((10, 200), (300, 200), (40, 0)) == 40 * 200
    assert sketch.block_offset((1, 5, 96), (4, 50, 96), (2, 10, 0)) == 2 * 50 * 96 + 10 * 96
    assert sketch.block_offset((1, 1, 7), (4, 50, 96), (3, 49, 80)) == 3 * 50 * 96 + 49 * 96 + 80
    assert sketch.block_offset((200, 64), (200, 120), (0, 56), transpose=True) == 56 * 200
    assert sketch.block_offset((), (), ()) == 0
    # Not one range: a column block, a sequence block of several samples, an [in, out] in-split.
    assert sketch.block_offset((300, 100), (300, 200), (0, 100)) is None
    assert sketch.block_offset((4, 5, 96), (4, 50, 96), (0, 10, 0)) is None
    assert sketch.block_offset((100, 120), (200, 120), (100, 0), transpose=True) is None


def test_hashing_by_integer_arithmetic_equals_the_definition():
    """The device path hashes indices with wrapping int64 arithmetic only: checked here with numpy."""
    spec = SketchSpec(buckets=512, seed=2**64 - 12345)
    positions = np.concatenate([np.arange(5000), np.arange(10**12, 10**12 + 5000), _rng().integers(0, 2**62, 5000)])
    negative = sketch.pattern_negative(spec).astype(np.int64)
    got = sketch.hashed_folded_index(positions.astype(np.int64), spec, np.int64, lambda j: negative[j])
    np.testing.assert_array_equal(got, sketch.folded_index(positions, spec))


# -- the numpy reference --------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reference_sketches_of_shards_add_up_to_the_whole(name):
    shape, splits, transpose = LAYOUTS[name]
    whole = _rng().normal(size=shape)
    parts = [sketch.sketch_array(whole[slices], SPEC, transpose=transpose, block=(shape, offsets))
             for slices, offsets in _shards(shape, splits)]
    np.testing.assert_allclose(sketch.merge(parts), sketch.sketch_array(whole, SPEC, transpose=transpose),
                               rtol=1e-9, atol=1e-9 * np.abs(whole).sum() / SPEC.buckets)


def test_reference_block_of_a_contiguous_range_equals_the_offset_form():
    x = _rng().normal(size=(300, 200))
    np.testing.assert_array_equal(sketch.sketch_array(x[40:90], SPEC, block=((300, 200), (40, 0))),
                                  sketch.sketch_array(x[40:90], SPEC, offset=40 * 200))


def test_offset_and_block_are_exclusive():
    with pytest.raises(ValueError, match="offset"):
        sketch.sketch_array(np.zeros((2, 3)), SPEC, offset=6, block=((4, 3), (2, 0)))
    with pytest.raises(ValueError, match="offset"):
        TorchSketcher(SPEC).sketch(torch.zeros(2, 3), offset=6, block=((4, 3), (2, 0)))
    with pytest.raises(ValueError, match="offset"):
        PaddleSketcher(SPEC).sketch(paddle.zeros([2, 3]), offset=6, block=((4, 3), (2, 0)))


def test_block_must_hold_the_tensor():
    with pytest.raises(ValueError, match="outside"):
        sketch.sketch_array(np.zeros((2, 3)), SPEC, block=((4, 3), (3, 0)))
    with pytest.raises(ValueError, match="outside"):
        TorchSketcher(SPEC).sketch(torch.zeros(2, 3), block=((4, 3), (3, 0)))
    with pytest.raises(ValueError, match="outside"):
        PaddleSketcher(SPEC).sketch(paddle.zeros([2, 3]), block=((4, 3), (3, 0)))


# -- device sketchers ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("hashed", [False, True], ids=["table", "hashed"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_device_sketches_of_shards_add_up_to_the_whole(framework, name, hashed, dtype):
    shape, splits, transpose = LAYOUTS[name]
    kwargs = {"max_table_elements": 0} if hashed else {}
    sketcher, to_tensor = _sketcher(framework, **kwargs)
    whole = _rng().normal(size=shape).astype(dtype)
    parts = []
    for slices, offsets in _shards(shape, splits):
        shard = whole[slices]
        got = _device_sketch(sketcher, to_tensor, shard, transpose=transpose, block=(shape, offsets))
        _close(got, sketch.sketch_array(shard, SPEC, transpose=transpose, block=(shape, offsets)), REL[dtype])
        parts.append(got)
    _close(sketch.merge(parts), sketch.sketch_array(whole, SPEC, transpose=transpose), REL[dtype])


def test_torch_and_paddle_agree_on_shards():
    shape, splits, transpose = LAYOUTS["both dims"]
    whole = _rng().normal(size=shape).astype(np.float32)
    (slices, offsets), = [s for s in _shards(shape, splits) if s[1] == (150, 77)]
    torch_sk, paddle_sk = TorchSketcher(SPEC), PaddleSketcher(SPEC)
    a = _device_sketch(torch_sk, torch.from_numpy, whole[slices], block=(shape, offsets))
    b = _device_sketch(paddle_sk, paddle.to_tensor, whole[slices], block=(shape, offsets))
    _close(a, b, 1e-6)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_contiguous_blocks_use_the_offset_path(framework):
    """A dim-0 shard holds no element table: it is the same cached plan as the offset form."""
    sketcher, to_tensor = _sketcher(framework)
    x = _rng().normal(size=(300, 200)).astype(np.float32)
    by_block = _device_sketch(sketcher, to_tensor, x[100:237], block=((300, 200), (100, 0)))
    by_offset = _device_sketch(sketcher, to_tensor, x[100:237], offset=100 * 200)
    (key,) = sketcher._plans  # one cached plan, keyed (device, element count, offset)
    assert key[1:] == (137 * 200, 100 * 200)
    np.testing.assert_array_equal(by_block, by_offset)
    # A sequence shard of one sample of a [batch, seq, hidden] activation is one range too.
    y = _rng().normal(size=(1, 13, 96)).astype(np.float32)
    _device_sketch(sketcher, to_tensor, y, block=((4, 50, 96), (2, 25, 0)))
    assert list(sketcher._plans)[-1][1:] == (13 * 96, 2 * 50 * 96 + 25 * 96)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_element_tables_cost_an_int32_per_element_and_the_hashed_path_none(framework):
    x = _rng().normal(size=(256, 512)).astype(np.float32)
    shape, offsets = (256, 1024), (0, 512)
    tabled, to_tensor = _sketcher(framework)
    _device_sketch(tabled, to_tensor, x, block=(shape, offsets))
    assert 4 * x.size <= _owned_bytes(tabled) < 4.1 * x.size
    hashed, _ = _sketcher(framework, max_table_elements=x.size - 1)
    want = _device_sketch(hashed, to_tensor, x, block=(shape, offsets))
    assert _owned_bytes(hashed) < 0.1 * 4 * x.size
    _close(want, sketch.sketch_array(x, SPEC, block=(shape, offsets)), 1e-6)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_hashed_path_across_several_bands(framework):
    """Above the table limit the device hashes ~1M elements at a time: a shard of several such bands."""
    sketcher, to_tensor = _sketcher(framework, max_table_elements=0)
    x = _rng().normal(size=(1100, 1000)).astype(np.float32)
    assert x.size > sketch.CHUNK_ELEMENTS
    block = ((1100, 3000), (0, 1700))
    _close(_device_sketch(sketcher, to_tensor, x, block=block), sketch.sketch_array(x, SPEC, block=block), 1e-6)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_plan_cache_stays_bounded_with_many_geometries(framework):
    """Dynamic shapes (a growing sequence, shards at many offsets) evict by count and by bytes."""
    sketcher, to_tensor = _sketcher(framework, max_plans=8, max_table_bytes=1 << 20)
    rng = _rng()
    for seq in range(1, 60):
        # A sequence-length that grows every step: one new geometry per call, last-dim shards.
        x = rng.normal(size=(2, seq, 48)).astype(np.float32)
        _device_sketch(sketcher, to_tensor, x, block=((2, seq, 96), (0, 0, 48)))
        assert len(sketcher._plans) <= 8
    for k in range(20):
        # Big tables: each 0.4 MiB, so the byte budget holds two of them.
        x = rng.normal(size=(200, 500)).astype(np.float32)
        _device_sketch(sketcher, to_tensor, x, block=((200, 1000 + k), (0, k)))
        assert sketcher.cached_bytes() <= (1 << 20) + _shared_bytes(sketcher)
    # Evicted geometries are rebuilt and sketch the same.
    x = rng.normal(size=(2, 3, 48)).astype(np.float32)
    first = _device_sketch(sketcher, to_tensor, x, block=((2, 3, 96), (0, 0, 48)))
    for k in range(10):
        _device_sketch(sketcher, to_tensor, x, block=((2, 3, 96 + k), (0, 0, 48)))
    np.testing.assert_array_equal(_device_sketch(sketcher, to_tensor, x, block=((2, 3, 96), (0, 0, 48))), first)


def _owned_bytes(sketcher) -> int:
    """Device bytes of the per-geometry cache entries."""
    return sum(entry.owned for entry in sketcher._plans.values())


def _shared_bytes(sketcher) -> int:
    """Device bytes that do not depend on the geometry (shared tables, patterns, scratch)."""
    return sketcher.cached_bytes() - _owned_bytes(sketcher)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_nan_in_one_shard_poisons_only_its_bucket(framework):
    sketcher, to_tensor = _sketcher(framework)
    x = _rng().normal(size=(64, 100))
    shard = x[:, 50:].copy()
    shard[3, 7] = np.nan
    got = _device_sketch(sketcher, to_tensor, shard, block=((64, 100), (0, 50)))
    poisoned = int(sketch.folded_index(np.array([3 * 100 + 57]), SPEC)[0] // 2)
    assert set(np.flatnonzero(~np.isfinite(got))) == {poisoned}
