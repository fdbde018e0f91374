"""Align two runs' operation sequences: the same operation in both, in order, tolerating what is not one.

A global alignment (Needleman-Wunsch) over (canonical name, output shape):
a pair of one name scores 2 (1 when the shapes differ), leaving out a view,
reshape, transpose or cast costs nothing (one framework writes ``matmul(q,
k.transpose())``, the other ``matmul(q, k, transpose_y=True)``), a tensor
made from nothing (a mask's ``full``) a little, any other operation 1.  One
row of the table at a time in numpy (a running maximum does the in-row
skips): two sequences of 1024 operations align in about 50 ms.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from twinstep.server.ops.trace import OpCall

#: Operations that move or reinterpret values without computing new ones: one side may do without them.
LAYOUT_OPS = frozenset({"reshape", "transpose", "cast", "contiguous", "clone", "detach", "expand", "squeeze",
                        "unsqueeze", "flatten", "unflatten", "view"})
_PAIR, _PAIR_RESHAPED = 2.0, 1.0


def skip_cost(call: OpCall) -> float:
    if call.op in LAYOUT_OPS:
        return 0.0
    if not call.inputs:
        return -0.5
    return -1.0


def align(base: Sequence[OpCall], cand: Sequence[OpCall]) -> list[tuple[int, int]]:
    """The (baseline index, candidate index) pairs of the best alignment, in order."""
    n, m = len(base), len(cand)
    if not n or not m:
        return []
    names = {name: k for k, name in enumerate(sorted({c.op for c in base} | {c.op for c in cand}))}
    shapes: dict[tuple[int, ...], int] = {}
    a_op = np.array([names[c.op] for c in base])
    b_op = np.array([names[c.op] for c in cand])
    a_shape = np.array([shapes.setdefault(c.output.shape, len(shapes)) for c in base])
    b_shape = np.array([shapes.setdefault(c.output.shape, len(shapes)) for c in cand])
    match = np.where(a_op[:, None] == b_op[None, :],
                     np.where(a_shape[:, None] == b_shape[None, :], _PAIR, _PAIR_RESHAPED), -np.inf)
    skip_a = np.array([skip_cost(c) for c in base])
    skip_b = np.array([skip_cost(c) for c in cand])
    prefix_b = np.concatenate([[0.0], np.cumsum(skip_b)])
    score = np.empty((n + 1, m + 1))
    score[0] = prefix_b
    for i in range(1, n + 1):
        previous = score[i - 1]
        best = np.maximum(previous[:-1] + match[i - 1], previous[1:] + skip_a[i - 1])
        start = previous[0] + skip_a[i - 1]
        run = np.maximum.accumulate(np.concatenate([[start], best - prefix_b[1:]]))
        score[i] = run + prefix_b
    pairs = []
    i, j = n, m
    while i > 0 and j > 0:
        if match[i - 1, j - 1] > -np.inf and score[i, j] == score[i - 1, j - 1] + match[i - 1, j - 1]:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif score[i, j] == score[i - 1, j] + skip_a[i - 1]:
            i -= 1
        else:
            j -= 1
    pairs.reverse()
    return pairs
