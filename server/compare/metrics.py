"""Scale-aware error metrics, vectorised over all records of a step.

Never a relative error of a near-zero quantity: a LayerNorm output's mean is
~1e-9, so |Δmean|/|mean| is noise.  Each difference is divided by a scale the
tensor really has: its RMS for moments, its largest magnitude for extrema.
"""

from __future__ import annotations

import numpy as np

from twinstep.wire import stats

#: Below this RMS a tensor counts as zero (float32 denormal range); avoids 0/0.
ABS_FLOOR = 1e-30


def from_statistics(base: dict[str, np.ndarray], cand: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """metric -> array over row-aligned records of two statistics tables."""
    return from_statistics_and_rms(base, cand)[0]


def from_statistics_and_rms(base: dict[str, np.ndarray], cand: dict[str, np.ndarray]
                            ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """:func:`from_statistics`, plus both sides' RMS (the comparator's scale factor needs them too)."""
    rms_b, rms_c = stats.rms(base), stats.rms(cand)
    scale = np.maximum(np.maximum(rms_b, rms_c), ABS_FLOOR)
    extent = np.maximum(np.maximum(base["abs_max"], cand["abs_max"]), ABS_FLOOR)
    with np.errstate(invalid="ignore", over="ignore"):
        extrema = np.maximum(np.abs(base["min"] - cand["min"]), np.abs(base["max"] - cand["max"])) / extent
        out = {
            # Relative difference of RMS: count-invariant, so broadcast shapes compare.
            "rms": np.abs(rms_b - rms_c) / scale,
            "mean": np.abs(stats.mean(base) - stats.mean(cand)) / scale,
            "extrema": extrema,
            "nonfinite": (
                np.abs(base["nan_count"] - cand["nan_count"]) + np.abs(base["inf_count"] - cand["inf_count"])
            ).astype(np.float64),
        }
    for name in ("rms", "mean", "extrema"):
        # Differences over positive scales: >= 0, +inf or NaN (never -inf); NaN counts as infinitely far.
        values = out[name]
        values[np.isnan(values)] = np.inf
    return out, rms_b, rms_c


def from_tensors(base: np.ndarray, cand: np.ndarray) -> dict[str, float]:
    """Element-wise metrics of two aligned full tensors, over their finite elements."""
    a = np.asarray(base, dtype=np.float64).reshape(-1)
    b = np.asarray(cand, dtype=np.float64).reshape(-1)
    finite = np.isfinite(a) & np.isfinite(b)
    if not finite.all():
        a, b = a[finite], b[finite]
    if a.size == 0:
        return {"max_abs": 0.0, "rel_l2": 0.0, "cosine": 0.0}
    diff = a - b
    norm_a = float(np.sqrt(np.dot(a, a)))
    norm_b = float(np.sqrt(np.dot(b, b)))
    norm_d = float(np.sqrt(np.dot(diff, diff)))
    if norm_a < ABS_FLOOR and norm_b < ABS_FLOOR:
        cosine_gap = 0.0
    elif norm_a < ABS_FLOOR or norm_b < ABS_FLOOR:
        cosine_gap = 1.0
    else:
        cosine_gap = max(0.0, 1.0 - float(np.dot(a, b)) / (norm_a * norm_b))
    if norm_a >= ABS_FLOOR:
        rel_l2 = norm_d / norm_a  # ||a-b|| / ||a||, a = baseline
    else:
        rel_l2 = 0.0 if norm_d < ABS_FLOOR else float("inf")
    return {"max_abs": float(np.abs(diff).max()), "rel_l2": rel_l2, "cosine": cosine_gap}
