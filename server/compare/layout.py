"""Storage layouts that differ between frameworks without meaning different numbers.

Decided from the framework and the owning module's type, never from shapes:
a square Linear weight looks the same either way, yet its layout differs.
"""

from __future__ import annotations

import numpy as np

# (framework, module type) -> parameter local names stored as [in, out] rather than [out, in].
_IN_OUT_WEIGHTS: dict[tuple[str, str], frozenset[str]] = {
    ("paddle", "Linear"): frozenset({"weight"}),
    ("paddle", "ColumnParallelLinear"): frozenset({"weight"}),
    ("paddle", "RowParallelLinear"): frozenset({"weight"}),
    ("paddle", "FusedLinear"): frozenset({"weight"}),
}


def is_in_out(framework: str, module_type: str, parameter_name: str) -> bool:
    local = parameter_name.rsplit(".", 1)[-1]
    return local in _IN_OUT_WEIGHTS.get((framework, module_type), frozenset())


def needs_transpose(base: tuple[str, str, str], cand: tuple[str, str, str]) -> bool:
    """Whether a candidate parameter must be transposed to the baseline's layout.

    Each side is (framework, owning module type, parameter name).
    """
    return is_in_out(*base) != is_in_out(*cand)


def shapes_compatible(base: tuple[int, ...], cand: tuple[int, ...], transpose: bool) -> bool:
    """Equal shapes, a layout transpose, or an equivalent broadcast ([1,S,D] vs [B,S,D])."""
    if transpose:
        cand = tuple(reversed(cand))
    if base == cand:
        return True
    try:
        common = np.broadcast_shapes(base, cand)
    except ValueError:
        return False
    # One side must be the other broadcast ([1,S,D] -> [B,S,D]); a mutual
    # broadcast ([8,1] vs [1,8]) is a different tensor, not an equivalent one.
    return common in (base, cand)


def align(base: np.ndarray, cand: np.ndarray, transpose: bool) -> tuple[np.ndarray, np.ndarray]:
    """Bring two full tensors to one shape for element-wise metrics."""
    if transpose:
        cand = cand.T
    if base.shape != cand.shape:
        base, cand = np.broadcast_arrays(base, cand)
    return base, cand
