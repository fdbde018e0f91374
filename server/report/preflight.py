"""The report's preflight section: differences between the runs' training set-ups, as JSON and as text."""

from __future__ import annotations

from typing import Any

from twinstep.v1 import twinstep_pb2 as pb

_TEXT_LIMIT = 20


def preflight_to_dict(report: pb.Report) -> list[dict[str, Any]]:
    return [{"candidate_run": f.candidate_run, "category": f.category, "key": f.key, "baseline": f.baseline,
             "candidate": f.candidate, "affects": list(f.affects), "affects_unlisted": f.affects_unlisted,
             "message": f.message, "severity": f.severity, "explained": f.explained,
             "explanation": f.explanation or None} for f in report.preflight]


def preflight_lines(report: pb.Report) -> list[str]:
    """One line per finding, warnings first; infos only counted past the first few."""
    if not report.preflight:
        return []
    warnings = [f for f in report.preflight if f.severity == "warning"]
    infos = [f for f in report.preflight if f.severity != "warning"]
    lines = [f"preflight: {len(warnings)} set-up difference(s) that can change the numerics"
             + (f", {len(infos)} for context" if infos else "")]
    lines += [f"  WARNING {f.message}" + (f" [{f.explanation}]" if f.explanation else "")
              for f in warnings[:_TEXT_LIMIT]]
    lines += [f"  info    {f.message}" for f in infos[: max(_TEXT_LIMIT - len(warnings), 0)]]
    shown = min(len(warnings), _TEXT_LIMIT) + min(len(infos), max(_TEXT_LIMIT - len(warnings), 0))
    if shown < len(report.preflight):
        lines.append(f"  ... and {len(report.preflight) - shown} more (twinstep report --json)")
    return lines
