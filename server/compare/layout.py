"""Storage layouts that differ between frameworks without meaning different numbers.

Decided from the framework and the owning module's type, never from shapes:
a square Linear weight looks the same either way, yet its layout differs.
"""

from __future__ import annotations

import numpy as np

from twinstep.wire.layouts import is_in_out

__all__ = ["is_in_out", "needs_transpose", "shapes_compatible", "align", "fused_shape", "fuse", "unfuse"]

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


def fused_shape(shapes: list[tuple[int, ...]], axis: int, groups: int) -> tuple[int, ...] | None:
    """Shape of the parts combined by ``fuse``; None when they cannot be (a shape divergence, not an error).

    The parts must have one rank, agree off ``axis``, and split into ``groups``
    equal chunks along it.
    """
    ndim = len(shapes[0])
    if groups < 1 or any(len(s) != ndim for s in shapes) or not -ndim <= axis < ndim:
        return None
    axis %= ndim
    if len({s[:axis] + s[axis + 1:] for s in shapes}) != 1 or any(s[axis] % groups for s in shapes):
        return None
    return shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:]


def fuse(parts: list[np.ndarray], axis: int, groups: int) -> np.ndarray:
    """The fused tensor: each part cut into ``groups`` chunks along ``axis``, chunks interleaved.

    [p1_0, p2_0, p3_0, p1_1, p2_1, p3_1, ...]; with G query heads per KV head and
    groups = KV heads this is a grouped-query qkv projection (paddleformers,
    Megatron); groups = 1 is a plain concatenation.  Shapes checked by fused_shape.
    """
    chunks = [np.split(part, groups, axis=axis) for part in parts]
    return np.concatenate([chunk[g] for g in range(groups) for chunk in chunks], axis=axis)


def unfuse(fused: np.ndarray, axis: int, groups: int, sizes: list[int]) -> list[np.ndarray]:
    """The inverse of ``fuse``: the parts, given each part's size along ``axis`` (shapes checked by fused_shape).

    Weight sync splits a fused baseline parameter (paddle's qkv_proj) into the
    candidate's parts (torch's q_proj, k_proj, v_proj).
    """
    chunk = [size // groups for size in sizes]
    bounds = np.cumsum(chunk)[:-1].tolist()
    per_group = [np.split(group, bounds, axis=axis) for group in np.split(fused, groups, axis=axis)]
    return [np.concatenate([group[k] for group in per_group], axis=axis) for k in range(len(sizes))]
