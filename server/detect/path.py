"""The way from an origin to where a tolerance was first crossed, record by record.

A divergence traced back to its origin names three things: the origin (step,
phase, module and its evidence), where a tolerance was first crossed, and the
path between them.  The path is read from the two comparisons the first
divergence keeps (the origin's step and the crossing's): the origin, the
origin's own record again at the crossing step (it still carries the error, or
no longer), then on the crossing step's forward pass every record from the
origin's module to the crossing one whose error at least doubles the largest
seen so far (where the error grows), and the crossing.  Errors are on the one
scale of twinstep.server.detect.evidence.
"""

from __future__ import annotations

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect import evidence
from twinstep.v1 import twinstep_pb2 as pb

#: Records listed between the origin and the crossing; further growth steps are left out.
MAX_BETWEEN = 8
#: A record joins the path when its error is this many times the largest one before it on the path.
GROWS = 2.0


def build(origin_row: Row, origin: StepComparison, crossed_row: Row | None,
          crossed: StepComparison | None, origin_words: str) -> list[pb.PathStep]:
    """The path from an origin to its crossing (only the origin while nothing crossed)."""
    first = _step(origin, origin_row, origin_words)
    path = [first]
    if crossed_row is None or crossed is None:
        return path
    end = crossed.rows.index(crossed_row)
    same = _find(crossed, origin_row)
    largest = first.error
    between: list[pb.PathStep] = []
    if same is not None and same != end:
        if crossed.step != origin.step:  # at the origin's own step the origin is already listed
            again = _step(crossed, crossed.rows[same], f"carries it at step {crossed.step}")
            between.append(again)
            largest = max(largest, again.error)
        start = same + 1
    else:
        start = end  # another phase, or the origin is not recorded at the crossing step: nothing in between
    if crossed_row.phase == "forward" and same is not None and same < end:
        worst, _ = evidence.errors(crossed)
        for k in range(start, end):
            row = crossed.rows[k]
            if row.phase != "forward" or worst[k] < GROWS * largest or worst[k] <= 0:
                continue
            grown = _step(crossed, row, f"grows it x{worst[k] / largest:.3g}" if largest > 0 else "grows it")
            largest = float(worst[k])
            between.append(grown)
    if len(between) > MAX_BETWEEN:
        between = between[:1] + between[-(MAX_BETWEEN - 1):]
    path.extend(between)
    path.append(_step(crossed, crossed_row, f"crosses its tolerance ({crossed_row.metric} {crossed_row.value:.3g} > "
                                            f"{crossed_row.tolerance:.3g})"))
    return path


def _find(comparison: StepComparison, row: Row) -> int | None:
    for k, r in enumerate(comparison.rows):
        if (r.phase, r.name, r.call_index, r.slot) == (row.phase, row.name, row.call_index, row.slot):
            return k
    return None


def _step(comparison: StepComparison, row: Row, note: str) -> pb.PathStep:
    k = _find(comparison, row)
    if k is None:  # a row rebuilt for the origin (parameters): its own figures
        error, metric = row.value, row.metric
    else:
        found = evidence.error_at(comparison, k)
        error, metric = found.value, found.metric
    given = evidence.input_error(comparison, row) if row.phase == "forward" else None
    return pb.PathStep(step=comparison.step, phase=row.phase, module=row.name, metric=metric, error=error,
                       input_error=given.value if given is not None else -1.0, note=note)
