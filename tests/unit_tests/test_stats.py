"""twinstep.wire.stats: float64 reference tables, derived values, merging, and m2 on the wire.

The capture backends' device statistics are tested against of_array in
test_device_stats.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from twinstep.wire import stats
from twinstep.runtime.capture.recorder import StepBatch
from twinstep.server.ingest.decode import decode_step
from twinstep.server.ingest.manifest import Manifest
from twinstep.server.errors import InputError
from twinstep.runtime.transport.messages import step_message
from twinstep.v1 import twinstep_pb2 as pb

RNG_SEED = 20240611


def _rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def _exact_m2(x: np.ndarray) -> float:
    """m2 in exact rational arithmetic via math.fsum (no rounding in the sums)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return 0.0
    mean = math.fsum(x) / x.size
    d = x - mean
    return math.fsum(d * d) - math.fsum(d) ** 2 / x.size


def test_fields_layout():
    assert stats.DEVICE_FIELDS == ("sum", "sum_sq", "min", "max", "abs_max", "nan_count", "inf_count", "m2")
    assert stats.FIELDS == ("count",) + stats.DEVICE_FIELDS


def test_empty_table_neutral_values_and_dtypes():
    table = stats.empty_table(3)
    assert set(table) == set(stats.FIELDS)
    for name in stats.FIELDS:
        assert table[name].shape == (3,)
        assert not table[name].any()
    for name in ("count", "nan_count", "inf_count"):
        assert table[name].dtype == np.int64
    for name in ("sum", "sum_sq", "min", "max", "abs_max", "m2"):
        assert table[name].dtype == np.float64


def test_of_array_matches_direct_formulas():
    x = _rng().normal(0.3, 2.0, size=(7, 11)).astype(np.float32)
    t = stats.of_array(x)
    x64 = x.astype(np.float64).ravel()
    assert t["count"].tolist() == [77]
    np.testing.assert_allclose(t["sum"], [np.sum(x64)], rtol=1e-13)
    np.testing.assert_allclose(t["sum_sq"], [np.sum(x64**2)], rtol=1e-13)
    np.testing.assert_allclose(t["m2"], [np.var(x64) * x64.size], rtol=1e-13)
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
        assert stats.variance(t)[0] == 0.0


def test_of_array_nan_inf_moments_over_finite_elements():
    x = np.array([1.0, np.nan, -4.0, np.inf, 2.5, -np.inf, np.nan, 0.5])
    t = stats.of_array(x)
    finite = np.array([1.0, -4.0, 2.5, 0.5])
    assert t["count"][0] == 8
    assert t["nan_count"][0] == 2
    assert t["inf_count"][0] == 2
    assert t["sum"][0] == pytest.approx(finite.sum())
    assert t["sum_sq"][0] == pytest.approx(np.dot(finite, finite))
    assert t["m2"][0] == pytest.approx(np.var(finite) * 4)
    assert t["min"][0] == -4.0
    assert t["max"][0] == 2.5
    assert t["abs_max"][0] == 4.0


def test_of_array_all_nonfinite():
    t = stats.of_array(np.array([np.nan, np.inf, -np.inf], dtype=np.float32))
    assert (t["count"][0], t["nan_count"][0], t["inf_count"][0]) == (3, 1, 2)
    for name in ("sum", "sum_sq", "min", "max", "abs_max", "m2"):
        assert t[name][0] == 0.0


def test_of_array_large_mean_m2_is_exact_where_the_naive_formula_fails():
    # 1e4 + N(0, 1): sum_sq/n - mean^2 cancels 8 of float64's 16 digits and all of float32's.
    x = 1e4 + _rng().standard_normal(100_000)
    t = stats.of_array(x)
    exact = _exact_m2(x)
    assert t["m2"][0] == pytest.approx(exact, rel=1e-12)
    assert stats.variance(t)[0] == pytest.approx(exact / x.size, rel=1e-12)
    x32 = x.astype(np.float32)
    naive32 = float(np.float32((x32 * x32).sum()) - np.float32(x32.sum()) ** 2 / np.float32(x32.size))
    assert abs(naive32 - _exact_m2(x32)) > 0.5 * _exact_m2(x32)  # the reference test can fail


def test_finite_count_with_nan_and_inf():
    x = np.array([1.0, np.nan, np.inf, 3.0, -np.inf, 5.0])
    t = stats.of_array(x)
    assert stats.finite_count(t).tolist() == [3]
    # mean, rms and std are over the 3 finite elements, not over all 6
    assert stats.mean(t)[0] == pytest.approx(3.0)
    assert stats.rms(t)[0] == pytest.approx(np.sqrt((1 + 9 + 25) / 3))
    assert stats.std(t)[0] == pytest.approx(np.std([1.0, 3.0, 5.0]))


def test_finite_count_is_at_least_one():
    t = stats.merge([stats.of_array(np.array([])), stats.of_array(np.array([np.nan, np.nan]))])
    assert stats.finite_count(t).tolist() == [1]
    assert t["m2"].tolist() == [0.0]


@pytest.mark.parametrize("shape", [(1000,), (3, 333)])
def test_mean_rms_std_variance_against_numpy(shape):
    x = _rng().normal(-1.5, 3.0, size=shape)
    t = stats.of_array(x)
    flat = x.ravel()
    assert stats.mean(t)[0] == pytest.approx(np.mean(flat), rel=1e-12)
    assert stats.rms(t)[0] == pytest.approx(np.sqrt(np.mean(flat**2)), rel=1e-12)
    assert stats.std(t)[0] == pytest.approx(np.std(flat), rel=1e-12)
    assert stats.variance(t)[0] == pytest.approx(np.var(flat), rel=1e-12)


def test_std_of_constant_tensor_is_zero_not_nan():
    t = stats.of_array(np.full(1001, 0.1))
    s = stats.std(t)[0]
    assert np.isfinite(s) and s == pytest.approx(0.0, abs=1e-12)


def test_std_of_a_table_without_m2_falls_back_to_the_sums():
    x = _rng().normal(2.0, 3.0, size=500)
    t = stats.of_array(x)
    del t["m2"]
    assert stats.std(t)[0] == pytest.approx(np.std(x), rel=1e-10)
    np.testing.assert_allclose(stats.m2_of_sums(stats.of_array(x)), [np.var(x) * x.size], rtol=1e-10)


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
    for name in ("sum", "sum_sq", "m2"):
        np.testing.assert_allclose(merged[name], whole[name], rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(stats.mean(merged), stats.mean(whole), rtol=1e-12)
    np.testing.assert_allclose(stats.rms(merged), stats.rms(whole), rtol=1e-12)
    np.testing.assert_allclose(stats.std(merged), stats.std(whole), rtol=1e-12)


def test_merge_m2_is_exact_for_large_mean_parts_with_different_means():
    # Chan's formula: the parts' spread enters through their means, never through sum_sq.
    rng = _rng()
    parts = [1e6 + rng.standard_normal(3000), 1e6 + 5 + rng.standard_normal(2000), np.array([np.nan, 1e6 - 3])]
    merged = stats.merge([stats.of_array(p) for p in parts])
    exact = _exact_m2(np.concatenate(parts))
    assert merged["m2"][0] == pytest.approx(exact, rel=1e-10)
    assert stats.m2_of_sums(merged)[0] != pytest.approx(exact, rel=1e-6)  # what the sums alone would give


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
        np.testing.assert_allclose(merged[name], ref[name], rtol=1e-15, err_msg=name)


def test_merge_needs_a_table():
    with pytest.raises(ValueError, match="at least one"):
        stats.merge([])


# -- helpers the backends use ----------------------------------------------------


def test_m2_from_sums_accepts_small_cancellation_and_refuses_large():
    unit = stats.unit_roundoff(4)
    x = _rng().normal(0.5, 1.0, size=1000)
    m2 = stats.m2_from_sums(x.size, x.sum(), np.dot(x, x), unit)
    assert m2 == pytest.approx(np.var(x) * x.size, rel=1e-12)
    y = 1e4 + x
    assert stats.m2_from_sums(y.size, y.sum(), np.dot(y, y), unit) is None
    assert stats.m2_from_sums(y.size, y.sum(), np.dot(y, y), stats.unit_roundoff(8)) is not None
    assert stats.m2_from_sums(1, 3.0, 9.0, unit) == 0.0
    assert stats.m2_from_sums(5, 0.0, 0.0, unit) == 0.0
    assert stats.m2_from_sums(4, 4.0, 4.0, unit) is None  # constant: 0 up to rounding, refused


def test_shifted_moments_recover_sum_sum_sq_and_m2():
    x = 1e4 + _rng().standard_normal(1000)
    shift = 1e4 + 0.01
    d = x - shift
    total, sum_sq, m2 = stats.shifted_moments(x.size, shift, d.sum(), np.dot(d, d))
    assert total == pytest.approx(x.sum(), rel=1e-14)
    assert sum_sq == pytest.approx(np.dot(x, x), rel=1e-14)
    assert m2 == pytest.approx(_exact_m2(x), rel=1e-11)
    assert stats.shifted_moments(0, 1.0, 0.0, 0.0) == (0.0, 0.0, 0.0)


# -- m2 on the wire ----------------------------------------------------------------


def _batch(device_stats: np.ndarray) -> StepBatch:
    n = len(device_stats)
    return StepBatch(
        step=3,
        phase=np.full(n, pb.LOSS, dtype=np.int32),
        target=np.zeros(n, dtype=np.uint32),
        call_index=np.zeros(n, dtype=np.uint32),
        slot=np.zeros(n, dtype=np.uint32),
        dtype=np.full(n, pb.FLOAT32, dtype=np.int32),
        ndim=np.ones(n, dtype=np.uint32),
        dims=[4] * n,
        count=np.full(n, 4, dtype=np.int64),
        device_stats=device_stats,
    )


def _rows(*arrays: np.ndarray) -> np.ndarray:
    return np.array([[stats.of_array(a)[f][0] for f in stats.DEVICE_FIELDS] for a in arrays], dtype=np.float64)


def test_m2_round_trips_from_batch_to_server_table():
    arrays = [1e4 + _rng().standard_normal(4), np.array([1.0, np.nan, 3.0, np.inf])]
    message = step_message(_batch(_rows(*arrays)), rank=0, dropped={})
    assert len(message.step.stats.m2) == 2
    data = decode_step(message.step, Manifest())
    for i, a in enumerate(arrays):
        ref = stats.of_array(a)
        for name in stats.FIELDS:
            assert data.table[name][i] == ref[name][0], name


@pytest.mark.parametrize(
    "m2, match",
    [([], "step 3: missing m2"),  # a client from before m2: the server no longer derives it from the sums
     ([1.0, 2.0], "column stats.m2 has 2 entries, phase has 1"), ([-1.0], "record 0 has stats.m2 -1.0"),
     ([float("nan")], "record 0 has stats.m2 nan")],
)
def test_server_rejects_bad_m2_with_invalid_argument(m2, match):
    message = step_message(_batch(_rows(np.arange(4.0))), rank=0, dropped={})
    del message.step.stats.m2[:]
    message.step.stats.m2.extend(m2)
    with pytest.raises(InputError, match=match) as error:
        decode_step(message.step, Manifest())
    assert error.value.code.name == "INVALID_ARGUMENT"
