"""The report's account of operations inside a module (server/ops): per capture and candidate rank, the culprit."""

from __future__ import annotations

import math
from typing import Any

from twinstep.v1 import twinstep_pb2 as pb


def operations_to_dict(report: pb.Report) -> list[dict[str, Any]]:
    """The ``operations`` key of the JSON form."""
    return [
        {"candidate_run": f.candidate_run, "rank": f.rank, "step": f.step, "module": f.module,
         "candidate_module": f.candidate_module, "zoom_id": f.zoom_id, "status": f.status,
         "baseline": _site(f.baseline) if f.HasField("baseline") and f.baseline.op else None,
         "candidate": _site(f.candidate) if f.HasField("candidate") and f.candidate.op else None,
         "metric": f.metric or None, "value": _finite(f.value), "tolerance": _finite(f.tolerance),
         "input_value": _finite(f.input_value), "ops_baseline": f.ops_baseline, "ops_candidate": f.ops_candidate,
         "ops_matched": f.ops_matched, "message": f.message}
        for f in report.operations
    ]


def operation_lines(report: pb.Report) -> list[str]:
    """Text lines: each comparison of a module's operations, and the line of the culprit."""
    if not report.operations:
        return []
    lines = ["operations inside a module:"]
    for f in report.operations:
        lines.append(f"  {f.candidate_run} rank {f.rank}, step {f.step}, {f.module or '(model)'!r} "
                     f"({f.ops_baseline} vs {f.ops_candidate} operations, {f.ops_matched} paired): {f.status}")
        lines.append(f"     {f.message}")
        for side, site in (("candidate", f.candidate), ("baseline", f.baseline)):
            if site.op and site.file:
                lines.append(f"     {side}: {site.file}:{site.line}  {site.code}")
    return lines


def _site(s: pb.OperationSite) -> dict[str, Any]:
    return {"index": s.index, "op": s.op, "api": s.api, "file": s.file, "line": s.line, "code": s.code,
            "shape": list(s.shape)}


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")
