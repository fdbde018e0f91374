"""rel_l2 and cosine of two full tensors, estimated from their count-sketches.

For a count-sketch ``S`` (``twinstep.wire.sketch``), ``||S(a)-S(b)||^2`` is an
unbiased estimate of ``||a-b||^2``; with ``m`` buckets its relative std is at
most ``sqrt(2/m)`` (equality when the difference is spread over many elements,
less when it sits in a few).  So

* ``rel_l2 = ||S(a)-S(b)|| / ||a||`` has a relative std of about ``1/sqrt(2m)``
  (4.4% at 256 buckets) when ``||a||`` is the exact norm from the statistics'
  ``sum_sq``, and about ``1/sqrt(m)`` from the sketch alone;
* the cosine gap ``1 - cos(a, b)`` is estimated as
  ``(|S(a)||S(b)| - <S(a),S(b)>) / (|a||b|)``: the numerator is invariant to a
  pure rescaling ``b = c*a`` (exactly 0, as the truth), and has a relative
  std of about ``sqrt(2/m)`` (8.8% at 256 buckets) with exact norms, ``2/sqrt(m)``
  without.

The error model treats ``m * estimate^2 / truth^2`` (rel_l2) and ``m *
estimate / truth`` (cosine gap) as chi-square with ``m`` degrees of freedom,
which ``benchmarks/sketch_accuracy.py`` checks on real tensors.  Below
``FLOOR_REL_L2`` the sketch's own float32 rounding dominates.  The hash is fixed
for a whole run, so a record's estimation error repeats from step to step
rather than averaging out.
"""

from __future__ import annotations

import numpy as np

from twinstep.server.compare.metrics import ABS_FLOOR

#: rel_l2 the sketches cannot resolve: a bucket is summed with up to ~2e-7
#: relative float32 error and sent as float32 (3.4e-8 rms).  Measured: estimates
#: within 1.0e-7 of the exact value for all 324 demo records with rel_l2 < 1e-6
#: (benchmarks/sketch_accuracy.py); 3e-7 leaves a margin.
FLOOR_REL_L2 = 3e-7
#: Default number of standard deviations for a significant excess.
DEFAULT_Z = 3.0


def from_sketches(base: np.ndarray, cand: np.ndarray, sum_sq_base: np.ndarray | None = None,
                  sum_sq_cand: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """metric -> array over row-aligned records: "rel_l2", "cosine" (the gap 1-cos) and "buckets".

    ``base``/``cand`` are [n, buckets] sketches (or one [buckets] vector);
    ``sum_sq_*`` are the records' exact squared norms from the statistics,
    which halve the estimates' variance.  Buckets that are NaN/Inf in either
    sketch (a NaN or Inf element fell in them) are left out and the rest scaled
    up, so the estimates cover roughly the finite elements; "buckets" is how many
    were used (0: no estimate, reported as NaN).
    """
    a = np.atleast_2d(np.asarray(base, dtype=np.float64))
    b = np.atleast_2d(np.asarray(cand, dtype=np.float64))
    if a.shape != b.shape:
        raise ValueError(f"sketch shapes differ: {a.shape} vs {b.shape}")
    finite = np.isfinite(a) & np.isfinite(b)
    used = finite.sum(axis=1)
    a = np.where(finite, a, 0.0)
    b = np.where(finite, b, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = a.shape[1] / used
        d2 = np.einsum("ij,ij->i", a - b, a - b) * scale
        sa = np.sqrt(np.einsum("ij,ij->i", a, a) * scale)
        sb = np.sqrt(np.einsum("ij,ij->i", b, b) * scale)
        # |Sa|-|Sb| without cancellation: (|Sa|^2-|Sb|^2)/(|Sa|+|Sb|), the numerator as <Sa-Sb, Sa+Sb>.
        radial = np.einsum("ij,ij->i", a - b, a + b) * scale / (sa + sb)
        radial = np.where(sa + sb > 0, radial, 0.0)
        # |Sa||Sb| - <Sa,Sb> = (|Sa-Sb|^2 - (|Sa|-|Sb|)^2) / 2
        numerator = np.maximum(d2 - radial * radial, 0.0) / 2
        norm_a = sa if sum_sq_base is None else np.sqrt(np.maximum(np.asarray(sum_sq_base, dtype=np.float64), 0.0))
        norm_b = sb if sum_sq_cand is None else np.sqrt(np.maximum(np.asarray(sum_sq_cand, dtype=np.float64), 0.0))
        norm_d = np.sqrt(d2)
        rel_l2 = np.where(norm_a >= ABS_FLOOR, norm_d / norm_a, np.where(norm_d < ABS_FLOOR, 0.0, np.inf))
        tiny_a, tiny_b = norm_a < ABS_FLOOR, norm_b < ABS_FLOOR
        cosine = np.where(tiny_a & tiny_b, 0.0, np.where(tiny_a | tiny_b, 1.0, numerator / (norm_a * norm_b)))
    cosine = np.clip(cosine, 0.0, 2.0)
    none = used == 0
    rel_l2[none] = np.nan
    cosine[none] = np.nan
    return {"rel_l2": rel_l2, "cosine": cosine, "buckets": used}


def relative_std(metric: str, buckets: np.ndarray | int, exact_norms: bool = True) -> np.ndarray:
    """Relative standard deviation of an estimate with ``buckets`` usable buckets."""
    m = np.maximum(np.asarray(buckets, dtype=np.float64), 1.0)
    if metric == "rel_l2":
        return np.sqrt(1 / (2 * m)) if exact_norms else np.sqrt(1 / m)
    if metric == "cosine":
        return np.sqrt(2 / m) if exact_norms else 2 / np.sqrt(m)
    raise ValueError(f"no error model for metric {metric!r} (expected rel_l2 or cosine)")


def _chi2_ratio_quantile(m: np.ndarray, z: float) -> np.ndarray:
    """Quantile of chi2_m / m at z standard normal deviations (Wilson-Hilferty)."""
    c = 2 / (9 * m)
    return np.maximum(1 - c + z * np.sqrt(c), 0.0) ** 3


def threshold(metric: str, tolerance: np.ndarray | float, buckets: np.ndarray | int, z: float = DEFAULT_Z,
              exact_norms: bool = True) -> np.ndarray:
    """The estimate above which the true value exceeds ``tolerance`` with z-sigma confidence.

    A true value equal to the tolerance gives estimates above it with
    probability ~Phi(-z) (0.13% at z=3).  Without exact norms the denominator's
    own noise doubles the chi-square variance (half the degrees of freedom).
    """
    m = np.maximum(np.asarray(buckets, dtype=np.float64), 1.0)
    if not exact_norms:
        m = m / 2
    tol = np.asarray(tolerance, dtype=np.float64)
    if metric == "rel_l2":
        return tol * np.sqrt(_chi2_ratio_quantile(m, z)) + z * FLOOR_REL_L2
    if metric == "cosine":
        return tol * _chi2_ratio_quantile(m, z)
    raise ValueError(f"no error model for metric {metric!r} (expected rel_l2 or cosine)")


def significantly_above(metric: str, estimate: np.ndarray | float, tolerance: np.ndarray | float,
                        buckets: np.ndarray | int, z: float = DEFAULT_Z, exact_norms: bool = True) -> np.ndarray:
    """Whether the true metric exceeds ``tolerance`` beyond the estimator's z-sigma noise (NaN: False)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(estimate, dtype=np.float64) > threshold(metric, tolerance, buckets, z, exact_norms)


def significantly_below(metric: str, estimate: np.ndarray | float, tolerance: np.ndarray | float,
                        buckets: np.ndarray | int, z: float = DEFAULT_Z, exact_norms: bool = True) -> np.ndarray:
    """Whether the true metric is within ``tolerance`` with z-sigma confidence (NaN: False).

    Between the two verdicts an estimate is undecided: a full tensor would tell.
    """
    m = np.maximum(np.asarray(buckets, dtype=np.float64), 1.0)
    if not exact_norms:
        m = m / 2
    tol = np.asarray(tolerance, dtype=np.float64)
    low = _chi2_ratio_quantile(m, -z)
    bound = tol * np.sqrt(low) - z * FLOOR_REL_L2 if metric == "rel_l2" else tol * low
    if metric not in ("rel_l2", "cosine"):
        raise ValueError(f"no error model for metric {metric!r} (expected rel_l2 or cosine)")
    with np.errstate(invalid="ignore"):
        return np.asarray(estimate, dtype=np.float64) < bound


def lower_bound(metric: str, estimate: np.ndarray, buckets: np.ndarray | int, z: float = DEFAULT_Z) -> np.ndarray:
    """The smallest true value an estimate is consistent with at z sigma (0 where NaN).

    ``lower_bound(m, e, b) > tol`` exactly when ``significantly_above(m, e, tol, b)``
    (exact norms), so a comparator can judge it like any other metric: a sketch
    raises an alarm only when the tensors differ beyond its own noise.
    """
    m = np.maximum(np.asarray(buckets, dtype=np.float64), 1.0)
    est = np.nan_to_num(np.asarray(estimate, dtype=np.float64), nan=0.0)
    q = _chi2_ratio_quantile(m, z)
    if metric == "rel_l2":
        return np.maximum((est - z * FLOOR_REL_L2) / np.sqrt(q), 0.0)
    if metric == "cosine":
        return est / q
    raise ValueError(f"no error model for metric {metric!r} (expected rel_l2 or cosine)")
