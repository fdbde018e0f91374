"""twinstep.stats (float64 reference tables) and the capture backends' device statistics.

The backends compute DEVICE_FIELDS on the device in the framework; of_array on
the exact float64 values of the same tensor is the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from twinstep import stats

RNG_SEED = 20240611


def _rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


# -- twinstep.stats ------------------------------------------------------------


def test_fields_layout():
    assert stats.DEVICE_FIELDS == ("sum", "sum_sq", "min", "max", "abs_max", "nan_count", "inf_count")
    assert stats.FIELDS == ("count",) + stats.DEVICE_FIELDS


def test_empty_table_neutral_values_and_dtypes():
    table = stats.empty_table(3)
    assert set(table) == set(stats.FIELDS)
    for name in stats.FIELDS:
        assert table[name].shape == (3,)
        assert not table[name].any()
    for name in ("count", "nan_count", "inf_count"):
        assert table[name].dtype == np.int64
    for name in ("sum", "sum_sq", "min", "max", "abs_max"):
        assert table[name].dtype == np.float64


def test_of_array_matches_direct_formulas():
    x = _rng().normal(0.3, 2.0, size=(7, 11)).astype(np.float32)
    t = stats.of_array(x)
    x64 = x.astype(np.float64).ravel()
    assert t["count"].tolist() == [77]
    np.testing.assert_allclose(t["sum"], [np.sum(x64)], rtol=1e-13)
    np.testing.assert_allclose(t["sum_sq"], [np.sum(x64**2)], rtol=1e-13)
    assert t["min"][0] == x64.min()
    assert t["max"][0] == x64.max()
    assert t["abs_max"][0] == np.abs(x64).max()
    assert t["nan_count"][0] == 0 and t["inf_count"][0] == 0


def test_of_array_empty():
    t = stats.of_array(np.zeros((0, 5), dtype=np.float32))
    assert t["count"][0] == 0
    for name in stats.DEVICE_FIELDS:
        assert t[name][0] == 0
    # Derived values of an empty tensor are zero, not NaN (no 0/0).
    with np.errstate(all="raise"):
        assert stats.mean(t)[0] == 0.0
        assert stats.rms(t)[0] == 0.0
        assert stats.std(t)[0] == 0.0


def test_of_array_nan_inf_moments_over_finite_elements():
    x = np.array([1.0, np.nan, -4.0, np.inf, 2.5, -np.inf, np.nan, 0.5])
    t = stats.of_array(x)
    finite = np.array([1.0, -4.0, 2.5, 0.5])
    assert t["count"][0] == 8
    assert t["nan_count"][0] == 2
    assert t["inf_count"][0] == 2
    assert t["sum"][0] == pytest.approx(finite.sum())
    assert t["sum_sq"][0] == pytest.approx(np.dot(finite, finite))
    assert t["min"][0] == -4.0
    assert t["max"][0] == 2.5
    assert t["abs_max"][0] == 4.0


def test_of_array_all_nonfinite():
    t = stats.of_array(np.array([np.nan, np.inf, -np.inf], dtype=np.float32))
    assert (t["count"][0], t["nan_count"][0], t["inf_count"][0]) == (3, 1, 2)
    for name in ("sum", "sum_sq", "min", "max", "abs_max"):
        assert t[name][0] == 0.0


def test_finite_count_with_nan_and_inf():
    x = np.array([1.0, np.nan, np.inf, 3.0, -np.inf, 5.0])
    t = stats.of_array(x)
    assert stats.finite_count(t).tolist() == [3]
    # mean and rms are over the 3 finite elements, not over all 6
    assert stats.mean(t)[0] == pytest.approx(3.0)
    assert stats.rms(t)[0] == pytest.approx(np.sqrt((1 + 9 + 25) / 3))


def test_finite_count_is_at_least_one():
    t = stats.merge([stats.of_array(np.array([])), stats.of_array(np.array([np.nan, np.nan]))])
    assert stats.finite_count(t).tolist() == [1]


@pytest.mark.parametrize("shape", [(1000,), (3, 333)])
def test_mean_rms_std_l2_against_numpy(shape):
    x = _rng().normal(-1.5, 3.0, size=shape)
    t = stats.of_array(x)
    flat = x.ravel()
    assert stats.mean(t)[0] == pytest.approx(np.mean(flat), rel=1e-12)
    assert stats.rms(t)[0] == pytest.approx(np.sqrt(np.mean(flat**2)), rel=1e-12)
    assert stats.std(t)[0] == pytest.approx(np.std(flat), rel=1e-9)
    assert stats.l2_norm(t)[0] == pytest.approx(np.linalg.norm(flat), rel=1e-12)


def test_std_of_constant_tensor_is_zero_not_nan():
    t = stats.of_array(np.full(1001, 0.1))
    s = stats.std(t)[0]
    assert np.isfinite(s) and s == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("cut", [1, 137, 500, 999])
def test_merge_of_two_halves_equals_whole(cut):
    x = _rng().normal(2.0, 5.0, size=1000)
    x[[3, 700]] = np.nan
    x[[10, 800]] = [np.inf, -np.inf]
    whole = stats.of_array(x)
    merged = stats.merge([stats.of_array(x[:cut]), stats.of_array(x[cut:])])
    assert set(merged) == set(stats.FIELDS)
    for name in ("count", "nan_count", "inf_count", "min", "max", "abs_max"):
        np.testing.assert_array_equal(merged[name], whole[name], err_msg=name)
    for name in ("sum", "sum_sq"):
        np.testing.assert_allclose(merged[name], whole[name], rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(stats.mean(merged), stats.mean(whole), rtol=1e-12)
    np.testing.assert_allclose(stats.rms(merged), stats.rms(whole), rtol=1e-12)


def test_merge_is_row_aligned_over_multi_row_tables():
    rng = _rng()
    a, b = rng.normal(size=50), rng.normal(10, 1, size=30)
    # Two tensors (rows), each split in two parts (tables).
    part1 = {k: np.concatenate([stats.of_array(a[:20])[k], stats.of_array(b[:7])[k]]) for k in stats.FIELDS}
    part2 = {k: np.concatenate([stats.of_array(a[20:])[k], stats.of_array(b[7:])[k]]) for k in stats.FIELDS}
    merged = stats.merge([part1, part2])
    for row, full in enumerate((a, b)):
        ref = stats.of_array(full)
        for name in stats.FIELDS:
            assert merged[name][row] == pytest.approx(ref[name][0], rel=1e-12), (row, name)


def test_merge_with_an_empty_part_is_neutral():
    x = _rng().normal(size=64)
    merged = stats.merge([stats.of_array(x), stats.of_array(np.array([]))])
    ref = stats.of_array(x)
    for name in stats.FIELDS:
        np.testing.assert_array_equal(merged[name], ref[name], err_msg=name)


def test_merge_needs_a_table():
    with pytest.raises(ValueError, match="at least one"):
        stats.merge([])


# -- capture backends' device statistics vs of_array ---------------------------


class _Torch:
    name = "torch"

    def __init__(self):
        import torch

        from twinstep.capture.torch import TorchBackend

        self.torch = torch
        self.backend = TorchBackend()

    def make(self, array: np.ndarray, dtype: str):
        t = self.torch.from_numpy(np.ascontiguousarray(array))
        return t.to(getattr(self.torch, dtype))

    def transpose(self, tensor):
        return tensor.t()

    def exact_values(self, tensor) -> np.ndarray:
        """The tensor's values as float64 (exact for every dtype used here)."""
        return tensor.to(self.torch.float64).numpy()


class _Paddle:
    name = "paddle"

    def __init__(self):
        import paddle

        from twinstep.capture.paddle import PaddleBackend

        self.paddle = paddle
        self.backend = PaddleBackend()

    def make(self, array: np.ndarray, dtype: str):
        source = np.ascontiguousarray(array)
        if dtype == "bool" or source.dtype == np.bool_:
            return self.paddle.to_tensor(source).astype(dtype)
        # astype from float64 rounds once, like torch's .to()
        return self.paddle.to_tensor(source.astype(np.float64)).astype(dtype)

    def transpose(self, tensor):
        return self.paddle.transpose(tensor, [1, 0])

    def exact_values(self, tensor) -> np.ndarray:
        return tensor.astype("float64").numpy()


_FRAMEWORKS = {"torch": _Torch, "paddle": _Paddle}
_made: dict[str, object] = {}


@pytest.fixture(params=["torch", "paddle"])
def fw(request):
    if request.param not in _made:
        pytest.importorskip(request.param)
        _made[request.param] = _FRAMEWORKS[request.param]()
    return _made[request.param]


def _device_row(fw, tensor) -> np.ndarray:
    host = fw.backend.stats_to_host([fw.backend.device_stats(tensor)])
    assert isinstance(host, np.ndarray)
    assert host.shape == (1, 7)
    assert host.dtype == np.float64
    return host[0]


def _assert_matches_reference(row: np.ndarray, ref: dict[str, np.ndarray], exact: np.ndarray, rtol: float):
    """Counts and extrema exact; sums within rtol (sum relative to the sum of magnitudes)."""
    got = dict(zip(stats.DEVICE_FIELDS, row.tolist()))
    assert got["nan_count"] == ref["nan_count"][0]
    assert got["inf_count"] == ref["inf_count"][0]
    for name in ("min", "max", "abs_max"):
        assert got[name] == ref[name][0], name
    finite = exact[np.isfinite(exact)]
    assert abs(got["sum"] - ref["sum"][0]) <= rtol * np.abs(finite).sum(), (got["sum"], ref["sum"][0])
    assert got["sum_sq"] == pytest.approx(ref["sum_sq"][0], rel=rtol, abs=1e-300)


# Backends may accumulate float32 (and widened float16/bfloat16) in float32 with
# a pairwise/cascade reduction: far below 1e-6 relative at these sizes, while
# any mistake (wrong field, no widening, squares not summed) is off by far more.
# float64 tensors and integers (converted to float64) are summed in float64.
ACC_RTOL = {"float32": 1e-6, "float16": 1e-6, "bfloat16": 1e-6, "float64": 1e-12, "int64": 1e-12}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_device_stats_random_floats(fw, dtype):
    x = _rng().normal(0.5, 3.0, size=(64, 48))
    t = fw.make(x, dtype)
    exact = fw.exact_values(t)
    ref = stats.of_array(exact)
    _assert_matches_reference(_device_row(fw, t), ref, exact, ACC_RTOL[dtype])


@pytest.mark.parametrize("dtype", ["int64", "int32", "int8", "uint8"])
def test_device_stats_integers(fw, dtype):
    x = _rng().integers(0 if dtype == "uint8" else -100, 100, size=(17, 9))
    t = fw.make(x, dtype)
    ref = stats.of_array(x)
    row = _device_row(fw, t)
    # small integers: every field exact
    np.testing.assert_array_equal(row, np.array([ref[f][0] for f in stats.DEVICE_FIELDS], dtype=np.float64))


def test_device_stats_bool(fw):
    x = np.array([[True, False, True], [True, True, False]])
    row = _device_row(fw, fw.make(x, "bool"))
    ref = stats.of_array(x.astype(np.float64))
    np.testing.assert_array_equal(row, np.array([ref[f][0] for f in stats.DEVICE_FIELDS]))
    assert row[0] == 4 and row[3] == 1 and row[2] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_device_stats_empty_tensor(fw, dtype):
    t = fw.make(np.zeros((0, 4)), dtype)
    row = _device_row(fw, t)
    ref = stats.of_array(np.zeros((0, 4)))
    np.testing.assert_array_equal(row, np.array([ref[f][0] for f in stats.DEVICE_FIELDS]))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_device_stats_nan_inf_counts_and_finite_moments(fw, dtype):
    x = _rng().normal(0.0, 2.0, size=200)
    x[[5, 17, 99]] = np.nan
    x[[0, 150]] = np.inf
    x[77] = -np.inf
    t = fw.make(x, dtype)
    exact = fw.exact_values(t)
    ref = stats.of_array(exact)
    assert ref["nan_count"][0] == 3 and ref["inf_count"][0] == 3  # the reference itself is right
    row = _device_row(fw, t)
    _assert_matches_reference(row, ref, exact, ACC_RTOL[dtype])
    assert np.all(np.isfinite(row))


def test_device_stats_only_nonfinite(fw):
    t = fw.make(np.array([np.nan, np.inf, np.nan, -np.inf]), "float32")
    row = _device_row(fw, t)
    assert row[5] == 2 and row[6] == 2
    np.testing.assert_array_equal(row[:5], np.zeros(5))


def _large_mean(fw):
    # mean 1e4, std 1e-2, 1M elements: the spread is 1e-6 of the magnitude.
    x = (1e4 + 1e-2 * _rng().standard_normal(1_000_000)).astype(np.float32)
    return x, stats.of_array(x), _device_row(fw, fw.make(x, "float32"))


def test_device_stats_large_mean_within_smallest_tolerance(fw):
    # float32 tensors are reduced in float32 (cascade/pairwise sums) for speed; the
    # error must stay far below the 1e-5 tolerances of the metrics built on them.
    x, ref, row = _large_mean(fw)
    assert abs(row[1] - ref["sum_sq"][0]) / ref["sum_sq"][0] < 1e-5
    assert abs(row[0] - ref["sum"][0]) / ref["sum"][0] < 1e-6
    assert row[2] == ref["min"][0] and row[3] == ref["max"][0] and row[4] == ref["abs_max"][0]
    assert row[5] == 0 and row[6] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_stats_sum_sq_does_not_overflow_for_finite_values(fw, dtype):
    x = np.array([3e19, -1.0, 2.0, -2e19])
    t = fw.make(x, dtype)
    exact = fw.exact_values(t)
    ref = stats.of_array(exact)
    assert np.isfinite(ref["sum_sq"][0])
    row = _device_row(fw, t)
    assert row[1] == pytest.approx(ref["sum_sq"][0], rel=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_device_stats_non_contiguous(fw, dtype):
    x = _rng().normal(size=(30, 20)) * 10
    if dtype == "int64":
        x = np.round(x)
    base = fw.make(x, dtype)
    t = fw.transpose(base)
    assert tuple(t.shape) == (20, 30)
    exact = fw.exact_values(t)
    np.testing.assert_array_equal(exact, fw.exact_values(base).T)
    ref = stats.of_array(exact)
    _assert_matches_reference(_device_row(fw, t), ref, exact, ACC_RTOL[dtype])


def test_stats_to_host_stacks_in_order(fw):
    arrays = [np.array([1.0, 2.0]), np.array([-5.0]), np.zeros((0,)), np.array([np.nan, 4.0])]
    tensors = [fw.make(a, "float32") for a in arrays]
    host = fw.backend.stats_to_host([fw.backend.device_stats(t) for t in tensors])
    assert host.shape == (4, 7) and host.dtype == np.float64
    for i, a in enumerate(arrays):
        ref = stats.of_array(a)
        np.testing.assert_array_equal(host[i], [ref[f][0] for f in stats.DEVICE_FIELDS], err_msg=str(i))
    empty = fw.backend.stats_to_host([])
    assert empty.shape == (0, 7) and empty.dtype == np.float64


def test_device_stats_float16_widened(fw):
    # Values near the float16 maximum: squaring in float16 would overflow.
    x = np.array([60000.0, -65504.0, 1.0, 300.0])
    t = fw.make(x, "float16")
    ref = stats.of_array(fw.exact_values(t))
    row = _device_row(fw, t)
    assert np.isfinite(row[1])
    assert row[1] == pytest.approx(ref["sum_sq"][0], rel=ACC_RTOL["float16"])
    assert row[4] == 65504.0
