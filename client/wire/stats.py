"""Framework-neutral layout of per-tensor statistics, shared by client and server.

A record's statistics are mergeable (sums add, extrema combine, ``m2`` combines
by Chan's formula), so shards of a tensor, or the parts of a fused module,
combine exactly.  Mean, RMS and std are derived, never sent.  ``count`` is the
element count; when a tensor holds NaN or Inf, sums, ``m2`` and extrema cover
its finite elements and ``nan_count``/``inf_count`` the rest, so one bad value
does not hide the numbers of the others.  A tensor with no finite element has
zero sums and extrema.

``m2`` is the sum of squared deviations from the record's own mean.  It is sent
because ``sum_sq/n - mean**2`` cancels catastrophically when the mean is large
against the spread (1e4 + N(0, 1) in float32 leaves no correct digit of the
variance); backends compute it by a stable scheme (:func:`m2_from_sums` and
:func:`shifted_moments` below).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np


#: Columns computed on the device, in this order, by every capture backend.
DEVICE_FIELDS = ("sum", "sum_sq", "min", "max", "abs_max", "nan_count", "inf_count", "m2")
#: All columns of a statistics table; ``count`` is known on the host from the shape.
FIELDS = ("count",) + DEVICE_FIELDS
#: Columns that hold counts (int64 in a table); the others are float64.
COUNT_FIELDS = ("count", "nan_count", "inf_count")

#: Relative error allowed in ``m2`` before a backend pays for a second, shifted pass.
#: Metrics built on statistics use tolerances of 1e-5 and above.
M2_RTOL = 1e-6


def empty_table(n: int = 0) -> dict[str, np.ndarray]:
    """A statistics table of n records with the neutral values of an empty tensor."""
    table = {name: np.zeros(n, dtype=np.float64) for name in DEVICE_FIELDS}
    for name in COUNT_FIELDS:
        table[name] = np.zeros(n, dtype=np.int64)
    return table


def finite_count(table: dict[str, np.ndarray]) -> np.ndarray:
    """Finite elements per record, at least 1 so that it can divide."""
    return np.maximum(_finite(table), 1)


def mean(table: dict[str, np.ndarray]) -> np.ndarray:
    return table["sum"] / finite_count(table)


def rms(table: dict[str, np.ndarray]) -> np.ndarray:
    """Root mean square: independent of element count, unlike the L2 norm."""
    return np.sqrt(np.maximum(table["sum_sq"], 0.0) / finite_count(table))


def variance(table: dict[str, np.ndarray]) -> np.ndarray:
    """Population variance of the finite elements, from ``m2`` (no cancellation)."""
    return _m2(table) / finite_count(table)


def std(table: dict[str, np.ndarray]) -> np.ndarray:
    return np.sqrt(variance(table))


def merge(tables: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Combine row-aligned tables of the parts of one tensor (e.g. fused projections).

    ``m2`` uses Chan et al.'s parallel formula, sum of the parts' m2 plus
    ``n_i (mean_i - mean)**2``: the deviations of the means carry the spread
    between parts, so the merged m2 is as exact as the parts'.
    """
    if not tables:
        raise ValueError("merge needs at least one table")
    out = {name: sum(t[name] for t in tables) for name in ("count", "sum", "sum_sq", "nan_count", "inf_count")}
    out["min"] = np.minimum.reduce([t["min"] for t in tables])
    out["max"] = np.maximum.reduce([t["max"] for t in tables])
    out["abs_max"] = np.maximum.reduce([t["abs_max"] for t in tables])
    total_n = sum(_finite(t) for t in tables)
    grand_mean = out["sum"] / np.maximum(total_n, 1)
    m2 = np.zeros_like(grand_mean)
    for t in tables:
        n = _finite(t)
        part_mean = t["sum"] / np.maximum(n, 1)
        m2 = m2 + _m2(t) + n * (part_mean - grand_mean) ** 2
    out["m2"] = m2
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
    total = x.sum()
    table["sum"][0] = total
    table["sum_sq"][0] = np.dot(x, x)
    table["min"][0] = x.min()
    table["max"][0] = x.max()
    table["abs_max"][0] = np.abs(x).max()
    d = x - total / x.size  # two passes: the textbook stable variance
    table["m2"][0] = max(np.dot(d, d) - d.sum() ** 2 / x.size, 0.0)
    return table


# -- the capture backends' CPU kernel -------------------------------------------
#
# Both backends hand a zero-copy numpy view of a CPU tensor (float32 or
# float64) to host_row.  Dense arrays take one compiled pass for the sums
# and extrema (twinstep.runtime.kernels) once it has loaded.  Before that, or without
# it, host_row makes one pass per reduction with no full-size temporary: min
# and max (NaN propagates, so they also prove there is no NaN/Inf), the sum (the framework's cascade sum for large tensors, numpy's
# pairwise sum for small ones), and the sum of squares as float32 dot products
# of 1024-element rows summed in float64 (a single dot or norm accumulates
# sequentially and drifts by 1e-4..1e-3 at 16M elements; x*x writes a
# temporary as large as the tensor).  m2 comes from the sums when the
# cancellation factor allows it (m2_from_sums), else from a second pass over
# x - mean (large-mean tensors only).  NaN/Inf, and magnitudes whose float32
# squares would overflow or underflow, take a float64 path (rare).  Numbers
# behind these choices: benchmarks/stats_kernels.py.

#: Row length of the sum of squares: short enough that float32 accumulation within
#: a row is good to ~1e-9, long enough that the per-row call costs little.
_ROW = 1024


def unit_roundoff(itemsize: int) -> float:
    """Error bound of a backend's float32 (itemsize 4) or float64 reductions, relative."""
    return 4.0 * math.ldexp(1.0, -53 if itemsize >= 8 else -24)


#: By itemsize: magnitudes [tiny, huge] for which float32 (float64) squares and row sums
#: stay normal and finite, and the unit roundoff of the reductions.
_RANGE_AND_UNIT = {4: (1e-18, 1e18, unit_roundoff(4)), 8: (1e-150, 1e150, unit_roundoff(8))}


def host_row(
    values: np.ndarray,
    framework_sum: Callable[[], float] | None = None,
    framework_extrema: Callable[[], tuple[float, float]] | None = None,
) -> tuple[float, ...]:
    """DEVICE_FIELDS of a float32/float64 array (a view of a CPU tensor), with no full-size temporary.

    One compiled pass when twinstep.runtime.kernels can serve; otherwise one pass per
    reduction, where ``framework_sum`` and ``framework_extrema`` compute the
    sum and (min, max) with the framework's own kernels where those beat
    numpy's (large tensors); they must propagate NaN like numpy does.
    """
    n = values.size
    if n == 0:
        return (0.0,) * len(DEVICE_FIELDS)
    from twinstep.runtime import kernels  # the training side's compiled kernels; the server never loads them

    ordered = _in_memory_order(values)
    fused = kernels.one_pass_moments(ordered.reshape(-1)) if ordered.flags.c_contiguous else None
    if fused is not None:
        total, sum_sq, lo, hi = fused
        if not (math.isfinite(total) and math.isfinite(sum_sq)):  # NaN/Inf, or float32 squares overflowed
            return _wide_row(values)
        return finish_row(values, total, sum_sq, lo, hi, unit=_RANGE_AND_UNIT[values.itemsize][2])
    if framework_extrema is not None:
        lo, hi = framework_extrema()
    else:
        lo = float(np.minimum.reduce(values, axis=None))
        hi = float(np.maximum.reduce(values, axis=None))
    if not _in_safe_range(lo, hi, values.itemsize):  # checked first: no float32 overflow below
        return _wide_row(values)
    total = framework_sum() if framework_sum is not None else float(np.add.reduce(values, axis=None))
    return finish_row(values, total, _sum_sq(values), lo, hi, unit=_RANGE_AND_UNIT[values.itemsize][2])


def finish_row(
    values: np.ndarray, total: float, sum_sq: float, lo: float, hi: float, *, unit: float
) -> tuple[float, ...]:
    """The row from one pass's sum, sum of squares and extrema (relative error ``unit``).

    Takes the float64 path when the extrema show NaN/Inf or extreme magnitudes, and
    a second, shifted pass when the sums cannot give m2 within M2_RTOL.
    """
    if not _in_safe_range(lo, hi, values.itemsize):
        return _wide_row(values)
    n = values.size
    m2 = m2_from_sums(n, total, sum_sq, unit)
    if m2 is None:
        # Large mean against the spread: sum the deviations from the mean, with the
        # shift rounded to the array's dtype so that it is exactly what was subtracted.
        shift = values.dtype.type(total / n)
        d = values - shift
        total, sum_sq, m2 = shifted_moments(n, float(shift), float(d.sum()), _sum_sq(d))
    return (total, sum_sq, lo, hi, max(-lo, hi), 0.0, 0.0, m2)


def _in_safe_range(lo: float, hi: float, itemsize: int) -> bool:
    abs_max = max(-lo, hi)
    tiny, huge, _ = _RANGE_AND_UNIT[itemsize]
    return abs_max <= huge and not 0.0 < abs_max < tiny  # NaN fails every comparison


def _sum_sq(y: np.ndarray) -> float:
    """Sum of squares without a full-size temporary and without sequential drift."""
    if y.ndim == 0:
        return float(y) ** 2
    y = _in_memory_order(y)
    if y.flags.c_contiguous:
        flat = y.reshape(-1)
        ragged = flat.size % _ROW
        if ragged == flat.size:
            return float(np.dot(flat, flat))  # under one row
        if not ragged:
            rows = flat.reshape(-1, _ROW)
            return float(np.add.reduce(_row_dots(rows), dtype=np.float64))
        body = flat.size - ragged
        rows = flat[:body].reshape(-1, _ROW)
        tail = flat[body:]
        return float(np.add.reduce(_row_dots(rows), dtype=np.float64)) + float(np.dot(tail, tail))
    return _strided_sum_sq(y)


def _row_dots(y: np.ndarray) -> np.ndarray:
    """Each innermost row's dot product with itself, in the array's dtype, with no full-size temporary.

    ``np.vecdot`` (numpy >= 2.0) where it exists; numpy 1.x (paddleformers pins 1.26)
    takes ``einsum``, which reads the rows the same way and sums in the same dtype.
    """
    if _VECDOT is not None:
        return _VECDOT(y, y)
    return np.einsum("...i,...i->...", y, y)


_VECDOT = getattr(np, "vecdot", None)


def _in_memory_order(y: np.ndarray) -> np.ndarray:
    """The array with its axes in memory order: a permuted dense tensor (a transposed gradient) becomes contiguous.

    Statistics do not depend on the order of the elements, so they read it that way.
    """
    if y.flags.c_contiguous:
        return y
    return y.transpose(np.argsort(y.strides)[::-1])


def _strided_sum_sq(y: np.ndarray) -> float:
    """Sliced tensors: dot products along the innermost axis in memory (last, after the transpose)."""
    if y.shape[-1] <= 16 * _ROW:
        return float(np.add.reduce(_row_dots(y), axis=None, dtype=np.float64))  # no copy
    return float((y * y).sum())  # long strided rows (rare): one temporary


def _wide_row(values: np.ndarray) -> tuple[float, ...]:
    """Rare path (NaN/Inf, extreme magnitudes): float64, moments over the finite elements."""
    wide = values.astype(np.float64).reshape(-1)
    nan = int(np.isnan(wide).sum())
    inf = int(np.isinf(wide).sum())
    if nan or inf:
        wide = wide[np.isfinite(wide)]
    n = wide.size
    if n == 0:
        return (0.0, 0.0, 0.0, 0.0, 0.0, float(nan), float(inf), 0.0)
    lo, hi = float(wide.min()), float(wide.max())
    with np.errstate(over="ignore"):  # finite float64 squares beyond 1e308 (only from float64 input)
        shift = float(wide.sum()) / n
        d = wide - shift
        total, sum_sq, m2 = shifted_moments(n, shift, float(d.sum()), float(np.dot(d, d)))
    return (total, sum_sq, lo, hi, max(-lo, hi), float(nan), float(inf), m2)


# -- helpers for the capture backends (host arithmetic on a few floats) --------


def m2_from_sums(count: int, total: float, sum_sq: float, unit: float) -> float | None:
    """``sum_sq - total**2/count`` when that keeps :data:`M2_RTOL`, else None.

    ``unit`` bounds the relative error of the backend's ``total`` and
    ``sum_sq`` (a few float32 or float64 epsilons).  The formula's relative
    error is about ``unit * sum_sq / m2`` (the cancellation factor), so it is
    used only while that stays below M2_RTOL: zero-mean activations and
    gradients pass; large-mean tensors get a shifted pass instead.
    """
    if count <= 1:
        return 0.0
    m2 = sum_sq - total * (total / count)
    if sum_sq == 0.0:
        return 0.0
    if m2 <= 0.0 or sum_sq * unit > M2_RTOL * m2:
        return None
    return m2


def shifted_moments(count: int, shift: float, dsum: float, dsum_sq: float) -> tuple[float, float, float]:
    """(sum, sum_sq, m2) from the sums of ``x - shift`` over ``count`` elements.

    With ``shift`` near the mean the deviations are small and exactly
    representable, so ``m2 = dsum_sq - dsum**2/count`` has no cancellation;
    ``sum_sq = m2 + sum**2/count`` adds two non-negative terms.
    """
    if count == 0:
        return 0.0, 0.0, 0.0
    m2 = max(dsum_sq - dsum * (dsum / count), 0.0)
    total = shift * count + dsum
    return total, m2 + total * (total / count), m2


def _finite(table: dict[str, np.ndarray]) -> np.ndarray:
    return table["count"] - table["nan_count"] - table["inf_count"]


def _m2(table: dict[str, np.ndarray]) -> np.ndarray:
    """``m2`` of a table, derived from the sums for tables that predate it."""
    m2 = table.get("m2")
    if m2 is not None:
        return np.maximum(m2, 0.0)
    return m2_of_sums(table)


def m2_of_sums(table: dict[str, np.ndarray]) -> np.ndarray:
    """``sum_sq - sum**2/n`` clamped at 0: the best m2 available from sums alone (old clients)."""
    n = finite_count(table)
    with np.errstate(invalid="ignore", over="ignore"):
        m2 = table["sum_sq"] - table["sum"] * (table["sum"] / n)
    return np.where(np.isnan(m2), 0.0, np.maximum(m2, 0.0))
