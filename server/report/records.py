"""The report's section on named records (Monitor.record) and batch sync, as JSON and text."""

from __future__ import annotations

import math
from typing import Any

from twinstep.v1 import twinstep_pb2 as pb

#: Names listed per candidate in text (the JSON form lists every one the server keeps).
_TEXT_NAMES = 40


def records_to_dict(report: pb.Report) -> list[dict[str, Any]]:
    """``records`` of the JSON form: per candidate and name, how its values compared."""
    return [
        {
            "candidate_run": r.candidate_run,
            "name": r.name,
            "dtype": r.dtype,
            "shape": list(r.shape),
            "exact": r.exact,
            "steps_compared": r.steps_compared,
            "steps_diverged": r.steps_diverged,
            "first_step": r.first_step if r.first_step >= 0 else None,
            "rank": r.rank,
            "metric": r.metric,
            "value": _number(r.value),
            "tolerance": _number(r.tolerance),
            "baseline_value": None if math.isnan(r.baseline_value) else _number(r.baseline_value),
            "candidate_value": None if math.isnan(r.candidate_value) else _number(r.candidate_value),
            "first_index": list(r.first_index) if r.first_step >= 0 and r.elements_differing > 0 else None,
            "elements_differing": r.elements_differing if r.elements_differing >= 0 else None,
        }
        for r in report.records
    ]


def batch_sync_to_dict(report: pb.Report) -> dict[str, Any] | None:
    """``batch_sync`` of the JSON form (null when the baseline published nothing)."""
    if not report.HasField("batch_sync"):
        return None
    b = report.batch_sync
    return {"published": b.published, "delivered": b.delivered, "dropped": b.dropped, "refused": b.refused,
            "held_bytes": b.held_bytes, "budget_bytes": b.budget_bytes}


def record_lines(report: pb.Report) -> list[str]:
    """Text lines: each named value, the step it first diverged at and what differed there."""
    out: list[str] = []
    if report.records:
        by_run: dict[str, list[pb.NamedRecord]] = {}
        for r in report.records:
            by_run.setdefault(r.candidate_run, []).append(r)
        for run, records in by_run.items():
            out.append(f"named records, candidate {run!r} (Monitor.record):")
            width = max(len(r.name) for r in records[:_TEXT_NAMES])
            for r in records[:_TEXT_NAMES]:
                out.append(f"  {r.name:<{width}}  {_describe(r)}")
            if len(records) > _TEXT_NAMES:
                out.append(f"  ... and {len(records) - _TEXT_NAMES} more (twinstep report --json lists every one)")
    if report.HasField("batch_sync"):
        b = report.batch_sync
        dropped = f", {b.dropped} dropped from the server's buffer before a candidate took them" if b.dropped else ""
        refused = f", {b.refused} refused" if b.refused else ""
        out.append(f"batch sync: the baseline published {b.published} batches, candidates took {b.delivered}"
                   f"{dropped}{refused}")
    return out


def _describe(r: pb.NamedRecord) -> str:
    shape = "scalar" if not r.shape else "x".join(map(str, r.shape))
    what = f"{r.dtype} {shape}, {r.steps_compared} steps compared"
    if r.first_step < 0:
        how = "exactly equal" if r.exact else f"within tolerance (closest {r.metric} {r.value:.3g} / {r.tolerance:.3g})"
        return f"{what}: {how}"
    detail = ""
    if not math.isnan(r.baseline_value):
        where = f" at [{', '.join(map(str, r.first_index))}]" if r.first_index else ""
        detail = f"; baseline {r.baseline_value:.6g}, candidate {r.candidate_value:.6g}{where}"
        if r.elements_differing > 0 and len(r.shape):
            detail += f" ({r.elements_differing} elements differ)"
    return (f"{what}: DIVERGED first at step {r.first_step} rank {r.rank} ({r.metric} {r.value:.3g} > "
            f"{r.tolerance:.3g}){detail}; diverged at {r.steps_diverged} step(s)")


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")
