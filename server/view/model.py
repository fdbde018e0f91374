"""The dashboard's view model: one JSON-able dict per session, the same live and in a kept HTML report.

Built from a Report (twinstep.server.report) and a HistoryCopy (twinstep.server.view.history), both
copies: never from live state.  Its shape is documented in docs/dashboard.md and versioned by
``VIEW_VERSION`` (major: a key removed or changed in meaning; minor: keys added).  The report inside
is the documented ``twinstep report --json`` form.

Heatmap cells travel as one byte each (base64): 0 where nothing was compared, 1..128 for an error
within tolerance and 129..255 beyond it, on a log scale of error over tolerance from 1e-3 to 1e3, so
the page colours and compares cells without parsing a number per cell, and "beyond tolerance" is
exact (never a rounding of the scale).
"""

from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twinstep.server.compare.tolerance import METRICS
from twinstep.server.report.render import report_to_dict
from twinstep.server.view.history import DIVERGENT, EMPTY, CurveCopy, ErrorsCopy, HistoryCopy
from twinstep.server.view.tree import module_tree
from twinstep.server.view.wire import merge_columns
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.wire.progress import steps_behind

VIEW_VERSION = "2.0"
LOG10_MIN, LOG10_MAX = -3.0, 3.0
#: Codes from here up are beyond tolerance.
OVER = 129
#: Columns a live view shows per candidate (older columns merged pairwise past it); a kept report shows all.
LIVE_COLUMNS = 160


@dataclass(frozen=True)
class LiveFacts:
    """What only a live server knows: how fast runs go, and whether this page may halt them."""

    steps_per_second: dict[str, float] = field(default_factory=dict)
    halt_enabled: bool = False
    halt_message: str = ""
    auth_required: bool = False


def build_view(report: pb.Report, history: HistoryCopy | None, live: LiveFacts | None = None,
               max_columns: int | None = LIVE_COLUMNS, now: float | None = None) -> dict[str, Any]:
    """The view of one session (``live=None``: a frozen view, as ``twinstep report --html`` keeps it)."""
    report_json = report_to_dict(report)
    kept = history is not None
    history = history or HistoryCopy(report.session, (), (), 0, 0.0)
    return {
        "view_version": VIEW_VERSION,
        "session": report.session,
        "live": live is not None,
        "history_kept": kept,
        "history_failure": history.failure or None,
        "generated_unix": time.time() if now is None else now,
        "status_label": _status_label(report),
        "report": report_json,
        "progress": _progress(report, live),
        "divergence": _divergence(report_json),
        "candidates": [_candidate(section) for section in report_json["candidates"]],
        "heatmap": {
            "metrics": list(METRICS),
            "scale": {"log10_min": LOG10_MIN, "log10_max": LOG10_MAX, "over_from": OVER},
            "steps_full_resolution": history.steps,
            "candidates": [_heatmap(errors, max_columns) for errors in history.errors],
        },
        "curves": _curves(history),
        "halt": {
            "enabled": bool(live and live.halt_enabled),
            "message": live.halt_message if live else "a kept report: nothing to halt",
            "outcome": _halt_outcome(report),
        },
        "auth_required": bool(live and live.auth_required),
        "history_revision": history.revision,
    }


# -- runs ----------------------------------------------------------------------------------------------


def _progress(report: pb.Report, live: LiveFacts | None) -> list[dict[str, Any]]:
    """Per run: role, step, speed, steps behind the furthest run, drops and capture health in one line."""
    out = []
    for r, behind in zip(report.runs, steps_behind([r.last_step for r in report.runs])):
        failing = [h for h in r.health if h.capture.failures or h.capture.failed_steps]
        records = sum(f.count for h in failing for f in h.capture.failures)
        steps = sum(h.capture.failed_steps for h in failing)
        rate = live.steps_per_second.get(r.name) if live else None
        out.append({
            "run": r.name,
            "role": "baseline" if r.baseline else "reference" if r.reference else "candidate",
            "framework": r.framework,
            "state": r.state,
            "ranks": r.ranks,
            "layout": r.layout_text or None,
            "last_step": r.last_step,
            "steps_per_second": None if rate is None or not math.isfinite(rate) else round(rate, 3),
            "steps_behind": behind,
            "dropped": r.dropped,
            "dropped_by_reason": dict(r.dropped_by_reason),
            "capture_ok": not failing,
            "capture_summary": "capture healthy" if not failing else
            f"capture failing on {len(failing)} rank(s): {records} record(s), {steps} whole step(s) not captured",
        })
    return out


def _halt_outcome(report: pb.Report) -> str | None:
    """What a session's halt did: the runs it stopped, the runs still stopping, or that it reached none."""
    if not report.halted:
        return None
    stopped = [r.name for r in report.runs if r.state == "halted"]
    streaming = [r.name for r in report.runs if r.state == "streaming"]
    if streaming:
        return f"Halt sent; waiting for {', '.join(streaming)} to stop."
    if stopped:
        return f"Halted: {', '.join(stopped)}."
    return "The halt reached no run: every run had ended before it."


def _status_label(report: pb.Report) -> str:
    """The header's badge: the verdict, and what a halt did ("halted" only when it stopped a run)."""
    if not report.halted:
        return report.status
    if any(r.state == "streaming" for r in report.runs):
        return f"{report.status} · halting"
    if any(r.state == "halted" for r in report.runs):
        return f"{report.status} · halted"
    return f"{report.status} · halt reached no run"


# -- the first divergence ------------------------------------------------------------------------------


def _divergence(report: dict[str, Any]) -> dict[str, Any] | None:
    """The first-divergence panel: where, the stage and culprit in words, and the module tree around it."""
    first = report["first_divergence"]
    if first is None:
        return None
    tree = report["tree"] or {"rows": []}
    names = [row["name"] for row in tree["rows"]]
    depths = _depths(names)
    return {
        "first": first,
        "stage": report["stage"],
        "culprit": report["culprit"],
        "tree": [{**row, "depth": depth} for row, depth in zip(tree["rows"], depths)],
    }


def _candidate(section: dict[str, Any]) -> dict[str, Any]:
    """One candidate's panel (three-way sessions show one each): its verdict and its own first divergence."""
    return {
        "run": section["candidate_run"],
        "framework": section["framework"],
        "status": section["status"],
        "halted": section["halted"],
        "steps_compared": section["steps_compared"],
        "divergence": _divergence(section),
    }


def _depths(names: list[str]) -> list[int]:
    """Indentation relative to the nearest ancestor that has a row of its own (as the text report shows)."""
    shown, depth, out = set(names), {}, []
    for name in names:
        parent = name
        level = 0
        while parent:
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
            if parent in shown:
                level = depth.get(parent, 0) + 1
                break
        depth[name] = level if name else 0
        out.append(depth[name])
    return out


# -- the heatmap -------------------------------------------------------------------------------------


def codes(errors: ErrorsCopy) -> np.ndarray:
    """One byte per cell (see the module's docstring), [rows, columns]."""
    ratio = errors.ratio()
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = (np.clip(np.log10(np.maximum(ratio, 1e-300)), LOG10_MIN, LOG10_MAX) - LOG10_MIN) \
            / (LOG10_MAX - LOG10_MIN)
    code = 1 + np.rint(scaled * 254).astype(np.int64)
    over = (errors.flags != EMPTY) & ((errors.flags & DIVERGENT) != 0)
    code = np.where(over, np.maximum(code, OVER), np.minimum(code, OVER - 1))
    return np.where(errors.flags == EMPTY, 0, code).astype(np.uint8)


def _heatmap(errors: ErrorsCopy, max_columns: int | None) -> dict[str, Any]:
    while max_columns and errors.value.shape[1] > max_columns:
        errors = merge_columns(errors)
    nodes = module_tree(errors.rows)
    own = codes(errors)
    metric = np.where(errors.flags == EMPTY, 255, errors.flags & 0x7F).astype(np.uint8)
    columns = errors.value.shape[1]
    cells = np.zeros((len(nodes), columns), dtype=np.uint8)
    metrics = np.full((len(nodes), columns), 255, dtype=np.uint8)
    rows = np.array([node.row for node in nodes], dtype=np.int64)
    recorded = rows >= 0
    cells[recorded] = own[rows[recorded]]
    metrics[recorded] = metric[rows[recorded]]
    return {
        "run": errors.run,
        "rows": [{"phase": n.phase, "path": n.path, "label": n.label, "depth": n.depth, "end": n.end,
                  "type": n.type, "recorded": n.row >= 0} for n in nodes],
        "columns": [[int(f), int(last)] for f, last in zip(errors.first_step.tolist(), errors.last_step.tolist())],
        "cells": base64.b64encode(cells.tobytes()).decode("ascii"),
        "metric": base64.b64encode(metrics.tobytes()).decode("ascii"),
        "rows_not_kept": errors.rows_not_kept,
    }


# -- the curves ----------------------------------------------------------------------------------------


def _curves(history: HistoryCopy) -> list[dict[str, Any]]:
    """Per candidate: both runs' loss and gradient norm, their difference, and the reference's noise band."""
    reference = next((c for c in history.curves if c.reference), None)
    out = []
    for curve in history.curves:
        if curve.reference:
            continue
        base_loss, loss, base_norm, norm = (curve.means[:, k] for k in range(4))
        with np.errstate(divide="ignore", invalid="ignore"):
            norm_rel = (norm - base_norm) / np.abs(base_norm)
        entry: dict[str, Any] = {
            "run": curve.run,
            "first_step": curve.first_step.tolist(),
            "last_step": curve.last_step.tolist(),
            "baseline_loss": _numbers(base_loss),
            "loss": _numbers(loss),
            "loss_diff": _numbers(loss - base_loss),
            "baseline_grad_norm": _numbers(base_norm),
            "grad_norm": _numbers(norm),
            "grad_norm_rel_diff": _numbers(norm_rel),
            "noise": None,
        }
        if reference is not None:
            band = _band(curve, reference)
            with np.errstate(divide="ignore", invalid="ignore"):
                norm_band = band[:, 1] / np.abs(base_norm)
            entry["noise"] = {
                "reference_run": reference.run,
                "multiple": history.noise_multiple,
                "loss": _numbers(band[:, 0]),
                "grad_norm_rel": _numbers(norm_band),
            }
        out.append(entry)
    return out


def _band(curve: CurveCopy, reference: CurveCopy) -> np.ndarray:
    """Per column of ``curve``: the reference's largest |difference from the baseline| over the same steps."""
    band = np.full((len(curve.first_step), 2), np.nan)
    if not len(reference.first_step):
        return band
    for c, (first, last) in enumerate(zip(curve.first_step.tolist(), curve.last_step.tolist())):
        overlap = (reference.first_step <= last) & (reference.last_step >= first)
        if overlap.any():
            band[c] = np.fmax.reduce(reference.max_diff[overlap], axis=0)
    return band


def _numbers(values: np.ndarray) -> list[float | None]:
    """JSON has no NaN or infinity: null."""
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, dtype=np.float64).tolist()]
