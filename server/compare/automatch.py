"""Propose a candidate-to-baseline module mapping when names differ.

Both runs' forward records of one step are aligned as sequences (the order
outputs were produced) by global alignment, scoring agreement of module
class, output shape and output statistics.  The result is a set of exact
rules the user can pin as a mapping file (``twinstep mapping SESSION``).
"""

from __future__ import annotations

import re

import numpy as np
import yaml

from twinstep.wire import stats
from twinstep.server.compare import layout
from twinstep.server.ingest.step import StepData
from twinstep.v1 import twinstep_pb2 as pb

_GAP = -1.0
_MAX_CELLS = 4_000_000  # beyond this, align greedily instead of by dynamic programming
_SYNONYMS = (
    (re.compile(r"(column|row)?parallel|fused|dense"), "linear"),
    (re.compile(r".*norm.*"), "norm"),
    (re.compile(r".*embed.*"), "embedding"),
)


def _kind(module_type: str) -> str:
    kind = module_type.lower()
    for pattern, replacement in _SYNONYMS:
        if pattern.fullmatch(kind) or (replacement == "linear" and pattern.search(kind) and "linear" in kind):
            return replacement
    return kind


def _outputs(data: StepData) -> list[int]:
    return [i for i in range(len(data)) if data.phase[i] == pb.FORWARD and data.call_index[i] == 0 and data.slot[i] == 0]


def propose(base: StepData, cand: StepData) -> dict[str, str]:
    """candidate module name -> baseline module name, for the pairs whose names differ."""
    bi, ci = _outputs(base), _outputs(cand)
    if not bi or not ci:
        return {}
    b_kind = [_kind(base.types[i]) for i in bi]
    c_kind = [_kind(cand.types[j]) for j in ci]
    b_rms = stats.rms({k: v[bi] for k, v in base.table.items()})
    c_rms = stats.rms({k: v[ci] for k, v in cand.table.items()})

    def score(x: int, y: int) -> float:
        if not layout.shapes_compatible(base.shapes[bi[x]], cand.shapes[ci[y]], False):
            return -5.0  # different tensors (e.g. one part of a fused projection): never a pair
        s = 2.0 if b_kind[x] == c_kind[y] else -1.0
        s += 2.0 if base.shapes[bi[x]] == cand.shapes[ci[y]] else 0.0
        scale = max(b_rms[x], c_rms[y], 1e-30)
        s += 2.0 if abs(b_rms[x] - c_rms[y]) / scale < 1e-3 else 0.0
        return s

    pairs = _align(len(bi), len(ci), score) if len(bi) * len(ci) <= _MAX_CELLS else _greedy(len(bi), len(ci), score)
    return {cand.names[ci[y]]: base.names[bi[x]] for x, y in pairs if cand.names[ci[y]] != base.names[bi[x]]}


def _align(n: int, m: int, score) -> list[tuple[int, int]]:
    """Needleman-Wunsch: the order-preserving pairing with the best total score."""
    table = np.zeros((n + 1, m + 1))
    table[:, 0] = _GAP * np.arange(n + 1)
    table[0, :] = _GAP * np.arange(m + 1)
    for x in range(1, n + 1):
        for y in range(1, m + 1):
            table[x, y] = max(table[x - 1, y - 1] + score(x - 1, y - 1), table[x - 1, y] + _GAP, table[x, y - 1] + _GAP)
    pairs = []
    x, y = n, m
    while x > 0 and y > 0:
        if table[x, y] == table[x - 1, y - 1] + score(x - 1, y - 1):
            if score(x - 1, y - 1) > 0:
                pairs.append((x - 1, y - 1))
            x, y = x - 1, y - 1
        elif table[x, y] == table[x - 1, y] + _GAP:
            x -= 1
        else:
            y -= 1
    return pairs[::-1]


def _greedy(n: int, m: int, score) -> list[tuple[int, int]]:
    """For very large models: walk both sequences, pairing the best match within a small window."""
    pairs, y = [], 0
    for x in range(n):
        window = range(y, min(m, y + 8))
        best = max(window, key=lambda j: score(x, j), default=None)
        if best is not None and score(x, best) > 2.0:
            pairs.append((x, best))
            y = best + 1
    return pairs


def to_yaml(proposal: dict[str, str]) -> str:
    """A mapping file the user can pin (``mapping_file`` in the server config)."""
    if not proposal:
        return ""
    return "# proposed by twinstep from call order, module classes, shapes and statistics\n" + yaml.safe_dump(
        {"exact": proposal}, sort_keys=False
    )
