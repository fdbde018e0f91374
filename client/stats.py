"""Framework-neutral layout of per-tensor statistics, shared by client and server.

A record's statistics are mergeable (sums add, extrema combine), so shards of a
tensor, or the parts of a fused module, combine exactly.  Mean, RMS and std are
derived, never sent.  ``count`` is the element count; when a tensor holds NaN or
Inf, sums and extrema cover its finite elements and ``nan_count``/``inf_count``
the rest, so one bad value does not hide the numbers of the others.
"""

from __future__ import annotations

import numpy as np

#: Columns computed on the device, in this order, by every capture backend.
DEVICE_FIELDS = ("sum", "sum_sq", "min", "max", "abs_max", "nan_count", "inf_count")
#: All columns of a statistics table; ``count`` is known on the host from the shape.
FIELDS = ("count",) + DEVICE_FIELDS


def empty_table(n: int = 0) -> dict[str, np.ndarray]:
    """A statistics table of n records with the neutral values of an empty tensor."""
    table = {name: np.zeros(n, dtype=np.float64) for name in DEVICE_FIELDS}
    table["count"] = np.zeros(n, dtype=np.int64)
    table["nan_count"] = table["nan_count"].astype(np.int64)
    table["inf_count"] = table["inf_count"].astype(np.int64)
    return table


def finite_count(table: dict[str, np.ndarray]) -> np.ndarray:
    return np.maximum(table["count"] - table["nan_count"] - table["inf_count"], 1)


def mean(table: dict[str, np.ndarray]) -> np.ndarray:
    return table["sum"] / finite_count(table)


def rms(table: dict[str, np.ndarray]) -> np.ndarray:
    """Root mean square: independent of element count, unlike the L2 norm."""
    return np.sqrt(np.maximum(table["sum_sq"], 0.0) / finite_count(table))


def l2_norm(table: dict[str, np.ndarray]) -> np.ndarray:
    return np.sqrt(np.maximum(table["sum_sq"], 0.0))


def std(table: dict[str, np.ndarray]) -> np.ndarray:
    m = mean(table)
    return np.sqrt(np.maximum(rms(table) ** 2 - m * m, 0.0))


def merge(tables: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Combine row-aligned tables of the parts of one tensor (e.g. fused projections)."""
    if not tables:
        raise ValueError("merge needs at least one table")
    out = {
        "count": sum(t["count"] for t in tables),
        "sum": sum(t["sum"] for t in tables),
        "sum_sq": sum(t["sum_sq"] for t in tables),
        "nan_count": sum(t["nan_count"] for t in tables),
        "inf_count": sum(t["inf_count"] for t in tables),
    }
    out["min"] = np.minimum.reduce([t["min"] for t in tables])
    out["max"] = np.maximum.reduce([t["max"] for t in tables])
    out["abs_max"] = np.maximum.reduce([t["abs_max"] for t in tables])
    return out


def of_array(values: np.ndarray) -> dict[str, np.ndarray]:
    """Reference statistics of one array, computed in float64 (tests, server fallbacks)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    table = empty_table(1)
    table["count"][0] = x.size
    if x.size == 0:
        return table
    table["nan_count"][0] = int(np.isnan(x).sum())
    table["inf_count"][0] = int(np.isinf(x).sum())
    x = x[np.isfinite(x)]
    if x.size == 0:
        return table
    table["sum"][0] = x.sum()
    table["sum_sq"][0] = np.dot(x, x)
    table["min"][0] = x.min()
    table["max"][0] = x.max()
    table["abs_max"][0] = np.abs(x).max()
    return table
