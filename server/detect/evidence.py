"""One scale of evidence per record: an error comparable across statistics and across modules.

A record's tolerance verdict names the metric that crossed, and that metric can
say nothing about a neighbour: the mean of a normalized tensor is ~0 on both
sides, so "its input matches (mean 1.7e-9)" says nothing about the input.
Every statistics metric is already a difference over the tensor's own scale
(server/compare/metrics.py: moments over the RMS, extrema over the largest
magnitude), so they compare with each other; the error of a record is the worst
of them, and of the relative L2 distance where full tensors or sketches were
compared.  The culprit, the growth factors, the stage, origin tracing and the
operations inspector all judge "matches", "creates" and "grows" on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinstep.server.compare.comparator import Row, StepComparison

#: Statistics every capture mode sends, each a difference over the tensor's own scale.
STAT_METRICS = ("rms", "mean", "extrema")
#: Full-tensor and sketch distances, on the same scale (relative L2); 0 where not compared.
TENSOR_METRICS = ("rel_l2", "sketch_rel_l2")
EVIDENCE_METRICS = STAT_METRICS + TENSOR_METRICS
#: An output error this many times its input's is created by the module, not passed on.
CREATES = 10.0


@dataclass(frozen=True)
class Error:
    """A record's error on the one scale, and the metric it comes from."""

    value: float
    metric: str

    def __str__(self) -> str:
        return f"{self.metric} {self.value:.3g}"


def errors(comparison: StepComparison) -> tuple[np.ndarray, np.ndarray]:
    """(error, index into EVIDENCE_METRICS of its metric) per row; computed once per comparison."""
    cached = comparison.evidence
    if cached is not None:
        return cached
    values = comparison.values
    if values and all(m in values for m in STAT_METRICS):
        stack = np.stack([np.asarray(values[m], dtype=np.float64) if m in values else
                          np.zeros(len(comparison.rows)) for m in EVIDENCE_METRICS])
        stack = np.nan_to_num(stack, nan=np.inf)
        which = stack.argmax(axis=0)
        worst = stack[which, np.arange(stack.shape[1])]
    else:  # rows built by hand (tests, replayed reports): the row's own metric is all there is
        rows = list(comparison.rows)
        worst = np.array([r.value for r in rows], dtype=np.float64)
        which = np.array([EVIDENCE_METRICS.index(r.metric) if r.metric in EVIDENCE_METRICS else 0 for r in rows])
    comparison.evidence = (worst, which)
    return worst, which


def error_at(comparison: StepComparison, k: int) -> Error:
    worst, which = errors(comparison)
    return Error(float(worst[k]), EVIDENCE_METRICS[int(which[k])])


def input_error(comparison: StepComparison, row: Row) -> Error | None:
    """The worst error over the captured inputs of ``row``'s module call; None when none was captured."""
    worst, which = errors(comparison)
    found: Error | None = None
    for r in _inputs(comparison, row):
        e = Error(float(worst[r]), EVIDENCE_METRICS[int(which[r])])
        if found is None or e.value > found.value:
            found = e
    return found


def input_rows(comparison: StepComparison, row: Row) -> list[Row]:
    """The captured input records of ``row``'s module call."""
    return [comparison.rows[k] for k in _inputs(comparison, row)]


def _inputs(comparison: StepComparison, row: Row) -> list[int]:
    return [k for k, r in enumerate(comparison.rows)
            if r.phase == "input" and r.name == row.name and r.call_index == row.call_index]


def growth(output: float, given: float) -> float:
    """Output error over input error (inf from an exactly equal input; 1 when both are 0)."""
    if given > 0:
        return output / given
    return math.inf if output > 0 else 1.0


def creates(output: float, given: float) -> bool:
    """Whether a module with this input and output error creates (most of) its output's error."""
    return output > 0 and given * CREATES <= output


def growth_words(output: float, given: float) -> str:
    factor = growth(output, given)
    return "from exactly 0" if math.isinf(factor) else f"x{factor:.3g}"
