"""A session's history as long-format CSV tables, for people's own analysis (``twinstep report --csv DIR``).

``errors.csv``: one line per candidate, column and module-phase row that was compared: the worst
record of that module in that phase over the column's steps (one step, or an older bucket of steps:
``step`` to ``last_step``).  ``curves.csv``: per run and column, the loss and global gradient norm of
the run and of the baseline.  Values are the server's float32, written in the shortest form that reads back exactly.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from twinstep.server.compare.tolerance import METRICS
from twinstep.server.view.history import CURVE_FIELDS, DIVERGENT, EMPTY, HistoryCopy

ERRORS_COLUMNS = ("candidate_run", "step", "last_step", "phase", "module", "type", "metric", "value", "tolerance",
                  "ratio", "divergent")
CURVES_COLUMNS = ("run", "reference", "step", "last_step", *CURVE_FIELDS, "loss_diff_max", "grad_norm_diff_max")


def write_tables(history: HistoryCopy, directory: str | Path) -> list[Path]:
    """Write errors.csv and curves.csv into ``directory`` (created if absent); returns their paths."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"cannot write tables into {directory}: it is a file, not a folder")
    directory.mkdir(parents=True, exist_ok=True)
    errors_path, curves_path = directory / "errors.csv", directory / "curves.csv"
    with errors_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(ERRORS_COLUMNS)
        for errors in history.errors:
            ratio = errors.ratio()
            for c in range(len(errors.first_step)):
                first, last = int(errors.first_step[c]), int(errors.last_step[c])
                for r in np.flatnonzero(errors.flags[:, c] != EMPTY).tolist():
                    phase, module, type_ = errors.rows[r]
                    flags = int(errors.flags[r, c])
                    writer.writerow([errors.run, first, last, phase, module, type_, METRICS[flags & 0x7F],
                                     _float32(errors.value[r, c]), _float32(errors.tolerance[r, c]),
                                     _number(ratio[r, c], ".6g"), int(bool(flags & DIVERGENT))])
    with curves_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CURVES_COLUMNS)
        for curve in history.curves:
            for c in range(len(curve.first_step)):
                writer.writerow([curve.run, int(curve.reference), int(curve.first_step[c]), int(curve.last_step[c]),
                                 *(_number(v, ".10g") for v in curve.means[c]),
                                 *(_number(v, ".10g") for v in curve.max_diff[c])])
    return [errors_path, curves_path]


def _float32(value: np.float32) -> str:
    """The shortest text that reads back as the same float32 (1e-05, not 9.99999975e-06); empty for NaN."""
    return "" if value != value else str(np.float32(value))


def _number(value: float, spec: str = ".9g") -> str:
    """Empty for NaN (not sent), "inf" for infinity: what spreadsheets and pandas read back."""
    value = float(value)
    if value != value:
        return ""
    return format(value, spec)
