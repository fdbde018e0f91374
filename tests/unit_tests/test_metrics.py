"""server/compare/metrics.py: scale-aware statistics metrics and full-tensor metrics."""

from __future__ import annotations

import numpy as np
import pytest

from twinstep.wire import stats
from twinstep.server.compare import metrics


def _layernorm_like(rows=64, dim=256, seed=0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(3.0, 5.0, size=(rows, dim))
    x = (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, keepdims=True)
    return x


def _table(*arrays) -> dict[str, np.ndarray]:
    parts = [stats.of_array(a) for a in arrays]
    return {k: np.concatenate([p[k] for p in parts]) for k in stats.FIELDS}


def test_layernorm_output_with_tiny_relative_noise_is_within_1e_5():
    x = _layernorm_like()
    assert abs(x.mean()) < 1e-9  # the case where |Δmean|/|mean| is meaningless
    noisy = x * (1.0 + 1e-7 * np.random.default_rng(1).standard_normal(x.shape))
    base, cand = stats.of_array(x), stats.of_array(noisy)
    # A naive relative error of the mean would flag it:
    naive = abs(stats.mean(base)[0] - stats.mean(cand)[0]) / abs(stats.mean(base)[0])
    assert naive > 1e-5
    values = metrics.from_statistics(base, cand)
    assert set(values) == {"rms", "mean", "extrema", "nonfinite"}
    for name, value in values.items():
        assert value.shape == (1,)
        assert value[0] <= 1e-5, (name, value)
    # the same noise in element-wise metrics
    tensor = metrics.from_tensors(x, noisy)
    assert tensor["rel_l2"] <= 1e-5 and tensor["cosine"] <= 1e-5


@pytest.mark.parametrize(
    "change,metric",
    [
        (lambda x: x + 1e-3, "mean"),  # a real shift
        (lambda x: x * (1 + 1e-3), "rms"),  # a real scale
        (lambda x: np.where(x == x.max(), x + 0.05, x), "extrema"),  # one outlier moves
    ],
)
def test_real_changes_exceed_1e_5(change, metric):
    x = _layernorm_like()
    values = metrics.from_statistics(stats.of_array(x), stats.of_array(change(x)))
    assert values[metric][0] > 1e-5, values


def test_mean_metric_value_is_shift_over_rms():
    x = _layernorm_like()
    values = metrics.from_statistics(stats.of_array(x), stats.of_array(x + 1e-3))
    rms_c = np.sqrt(np.mean((x + 1e-3) ** 2))
    assert values["mean"][0] == pytest.approx(1e-3 / max(1.0, rms_c), rel=1e-6)
    extent = max(np.abs(x).max(), np.abs(x + 1e-3).max())
    assert values["extrema"][0] == pytest.approx(1e-3 / extent, rel=1e-6)


def test_from_statistics_is_vectorised_row_by_row():
    x = _layernorm_like(rows=8, dim=32)
    y = np.random.default_rng(3).normal(100.0, 1.0, size=500)
    base = _table(x, y, np.zeros(4))
    cand = _table(x, y * 1.01, np.zeros(4))
    values = metrics.from_statistics(base, cand)
    for name in ("rms", "mean", "extrema", "nonfinite"):
        assert values[name].shape == (3,)
    assert values["rms"][0] == 0 and values["mean"][0] == 0 and values["extrema"][0] == 0
    assert values["rms"][1] == pytest.approx(0.01 / 1.01, rel=1e-6)
    # two all-zero tensors: no 0/0, no NaN
    assert values["rms"][2] == 0 and values["mean"][2] == 0 and values["extrema"][2] == 0


def test_rms_metric_is_count_invariant_for_broadcast():
    x = np.random.default_rng(4).normal(size=(1, 5, 8))
    big = np.broadcast_to(x, (4, 5, 8))
    values = metrics.from_statistics(stats.of_array(x), stats.of_array(big))
    for name in ("rms", "mean", "extrema", "nonfinite"):
        assert values[name][0] == pytest.approx(0.0, abs=1e-15), name


def test_nan_count_mismatch_shows_in_nonfinite():
    x = np.random.default_rng(5).normal(size=100)
    y = x.copy()
    y[[3, 50]] = np.nan
    y[7] = np.inf
    values = metrics.from_statistics(stats.of_array(x), stats.of_array(y))
    assert values["nonfinite"][0] == 3
    z = x.copy()
    z[[3, 50]] = np.inf  # same count of bad values, but Inf instead of NaN
    z[7] = np.nan
    values = metrics.from_statistics(stats.of_array(y), stats.of_array(z))
    assert values["nonfinite"][0] == 2  # |2-1| nan + |1-2| inf
    values = metrics.from_statistics(stats.of_array(y), stats.of_array(y))
    assert values["nonfinite"][0] == 0


def test_non_finite_statistics_become_inf_not_nan():
    base = stats.of_array(np.array([1.0, 2.0]))
    cand = {k: v.copy() for k, v in base.items()}
    cand["sum_sq"] = np.array([np.inf])
    cand["max"] = np.array([np.nan])
    values = metrics.from_statistics(base, cand)
    for name in ("rms", "extrema"):
        assert values[name][0] == np.inf, name
    assert not any(np.isnan(v).any() for v in values.values())


def _direct(a: np.ndarray, b: np.ndarray):
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    rel_l2 = np.linalg.norm(a - b) / np.linalg.norm(a)
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    return rel_l2, 1.0 - cos, np.max(np.abs(a - b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_from_tensors_against_numpy_formulas(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(16, 32)).astype(np.float32)
    b = a + rng.normal(scale=0.05, size=a.shape).astype(np.float32)
    got = metrics.from_tensors(a, b)
    rel_l2, cos_gap, max_abs = _direct(a, b)
    assert got["rel_l2"] == pytest.approx(rel_l2, rel=1e-10)
    assert got["cosine"] == pytest.approx(cos_gap, rel=1e-6)
    assert got["max_abs"] == pytest.approx(max_abs, rel=1e-12)
    assert got["rel_l2"] > 0.01  # the noise is really there


def test_rel_l2_is_relative_to_the_baseline():
    a = np.array([3.0, 4.0])  # norm 5
    b = np.array([0.0, 0.0])
    assert metrics.from_tensors(a, b)["rel_l2"] == pytest.approx(1.0)
    assert metrics.from_tensors(a, 2 * a)["rel_l2"] == pytest.approx(1.0)
    assert metrics.from_tensors(2 * a, a)["rel_l2"] == pytest.approx(0.5)
    # cosine gap ignores scale
    assert metrics.from_tensors(a, 2 * a)["cosine"] == pytest.approx(0.0, abs=1e-15)
    assert metrics.from_tensors(a, -a)["cosine"] == pytest.approx(2.0)


def test_from_tensors_ignores_non_finite_positions():
    rng = np.random.default_rng(7)
    a = rng.normal(size=50)
    b = a * 1.001
    a[4] = np.nan
    b[9] = np.inf
    got = metrics.from_tensors(a, b)
    rel_l2, cos_gap, max_abs = _direct(a, b)
    assert np.isfinite(got["rel_l2"]) and got["rel_l2"] == pytest.approx(rel_l2, rel=1e-10)
    assert got["max_abs"] == pytest.approx(max_abs, rel=1e-12)


def test_from_tensors_zero_and_empty_edges():
    z = np.zeros(10)
    x = np.ones(10)
    assert metrics.from_tensors(z, z) == {"max_abs": 0.0, "rel_l2": 0.0, "cosine": 0.0}
    zero_base = metrics.from_tensors(z, x)
    assert zero_base["rel_l2"] == np.inf and zero_base["cosine"] == 1.0 and zero_base["max_abs"] == 1.0
    zero_cand = metrics.from_tensors(x, z)
    assert zero_cand["rel_l2"] == 1.0 and zero_cand["cosine"] == 1.0
    assert metrics.from_tensors(np.array([]), np.array([])) == {"max_abs": 0.0, "rel_l2": 0.0, "cosine": 0.0}
    all_nan = np.full(3, np.nan)
    assert metrics.from_tensors(all_nan, all_nan)["rel_l2"] == 0.0
