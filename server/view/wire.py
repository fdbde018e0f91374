"""A session's history on the wire (GetHistory): HistoryCopy to pb.History and back.

The server sends it for ``twinstep report --html/--csv``; the command rebuilds the same copy the live
dashboard works from, so a kept report shows what the dashboard showed.
"""

from __future__ import annotations

import numpy as np

from twinstep.server.compare.tolerance import METRICS
from twinstep.server.view.history import (DIVERGENT, EMPTY, CurveCopy, ErrorsCopy, HistoryCopy, ratios)
from twinstep.v1 import twinstep_pb2 as pb

#: Cells (rows x columns over every candidate) one GetHistory answer carries at most: 13 bytes each, so
#: about 40 MB, under the server's 64 MiB send limit.  Past it, columns are merged pairwise.
MAX_CELLS = 3_000_000
_NO_METRIC = 255


def to_proto(history: HistoryCopy, max_cells: int = MAX_CELLS) -> pb.History:
    out = pb.History(session=history.session, metrics=METRICS, steps=history.steps,
                     noise_multiple=history.noise_multiple, revision=history.revision)
    cells = sum(e.value.size for e in history.errors)
    for errors in history.errors:
        while cells > max_cells and errors.value.shape[1] > 1:
            before = errors.value.size
            errors = merge_columns(errors)
            cells -= before - errors.value.size
        message = out.candidates.add(candidate_run=errors.run, rows_not_kept=errors.rows_not_kept)
        for phase, module, type_ in errors.rows:
            message.rows.add(phase=phase, module=module, type=type_)
        message.first_step.extend(errors.first_step.tolist())
        message.last_step.extend(errors.last_step.tolist())
        message.value.extend(errors.value.ravel().tolist())
        message.tolerance.extend(errors.tolerance.ravel().tolist())
        flags = errors.flags.ravel()
        metric = np.where(flags == EMPTY, _NO_METRIC, flags & 0x7F).astype(np.uint8)
        message.metric = metric.tobytes()
        message.divergent = ((flags != EMPTY) & ((flags & DIVERGENT) != 0)).astype(np.uint8).tobytes()
    for curve in history.curves:
        out.curves.add(
            run=curve.run, reference=curve.reference,
            first_step=curve.first_step.tolist(), last_step=curve.last_step.tolist(),
            baseline_loss=curve.means[:, 0].tolist(), loss=curve.means[:, 1].tolist(),
            baseline_grad_norm=curve.means[:, 2].tolist(), grad_norm=curve.means[:, 3].tolist(),
            loss_diff_max=curve.max_diff[:, 0].tolist(), grad_norm_diff_max=curve.max_diff[:, 1].tolist(),
        )
    return out


def from_proto(message: pb.History) -> HistoryCopy:
    """The copy a server sent; ValueError when its arrays do not fit its rows and columns."""
    names = list(message.metrics)
    remap = np.full(256, EMPTY, dtype=np.uint8)  # the sender's metric indices -> ours (by name)
    for k, name in enumerate(names[:_NO_METRIC]):
        if name in METRICS:
            remap[k] = METRICS.index(name)
    errors = []
    for c in message.candidates:
        rows, columns = len(c.rows), len(c.first_step)
        cells = rows * columns
        if (len(c.last_step) != columns or len(c.value) != cells or len(c.tolerance) != cells
                or len(c.metric) != cells or len(c.divergent) != cells):
            raise ValueError(f"history of candidate {c.candidate_run!r}: {rows} rows x {columns} columns do not "
                             "match its cells; is the server's twinstep of another version?")
        metric = remap[np.frombuffer(c.metric, dtype=np.uint8)]
        divergent = np.frombuffer(c.divergent, dtype=np.uint8) != 0
        flags = np.where(metric == EMPTY, EMPTY, metric | np.where(divergent, DIVERGENT, 0)).astype(np.uint8)
        errors.append(ErrorsCopy(
            run=c.candidate_run, rows=tuple((r.phase, r.module, r.type) for r in c.rows),
            first_step=np.array(c.first_step, dtype=np.int64), last_step=np.array(c.last_step, dtype=np.int64),
            value=np.array(c.value, dtype=np.float32).reshape(rows, columns),
            tolerance=np.array(c.tolerance, dtype=np.float32).reshape(rows, columns),
            flags=flags.reshape(rows, columns), rows_not_kept=c.rows_not_kept,
        ))
    curves = []
    for c in message.curves:
        columns = len(c.first_step)
        series = [c.baseline_loss, c.loss, c.baseline_grad_norm, c.grad_norm, c.loss_diff_max, c.grad_norm_diff_max]
        if len(c.last_step) != columns or any(len(s) != columns for s in series):
            raise ValueError(f"curve of run {c.run!r}: its series do not all have {columns} columns")
        curves.append(CurveCopy(
            run=c.run, reference=c.reference,
            first_step=np.array(c.first_step, dtype=np.int64), last_step=np.array(c.last_step, dtype=np.int64),
            means=np.array(series[:4], dtype=np.float64).T.reshape(columns, 4),
            max_diff=np.array(series[4:], dtype=np.float64).T.reshape(columns, 2),
        ))
    return HistoryCopy(message.session, tuple(errors), tuple(curves), message.steps, message.noise_multiple,
                       message.revision)


def merge_columns(errors: ErrorsCopy) -> ErrorsCopy:
    """Half the columns: each pair of neighbours becomes one holding the worse record of each row."""
    m = errors.value.shape[1]
    if m < 2:
        return errors
    left = np.arange(0, m, 2)
    right = np.minimum(left + 1, m - 1)
    ratio = ratios(errors.value, errors.tolerance, errors.flags)
    take_right = ratio[:, right] > ratio[:, left]
    pick = np.where(take_right, right[None, :], left[None, :])
    rows = np.arange(errors.value.shape[0])[:, None]
    return ErrorsCopy(
        run=errors.run, rows=errors.rows,
        first_step=errors.first_step[left], last_step=errors.last_step[right],
        value=errors.value[rows, pick], tolerance=errors.tolerance[rows, pick], flags=errors.flags[rows, pick],
        rows_not_kept=errors.rows_not_kept,
    )
