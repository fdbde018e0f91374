"""The report's account of live capture control: the zooms asked, and the steps that got full tensors."""

from __future__ import annotations

import math
from typing import Any

from twinstep.v1 import twinstep_pb2 as pb


def zooms_to_dict(report: pb.Report) -> list[dict[str, Any]]:
    """The ``zooms`` key of the JSON form."""
    return [
        {"id": w.spec.id, "origin": w.origin, "modules": list(w.spec.modules), "capture": w.spec.capture,
         "sketch": w.spec.sketch, "every": w.spec.every or 1, "first_step": w.spec.first_step,
         "last_step": w.spec.last_step, "bundle_module": w.spec.bundle_module or None,
         "divergent_step": w.spec.divergent_step if w.spec.divergent_step >= 0 else None,
         "reason": w.spec.reason, "runs": list(w.runs), "state": w.state, "ops_module": w.spec.ops_module or None}
        for w in report.zooms
    ]


def tensor_steps_to_dict(report: pb.Report) -> list[dict[str, Any]]:
    """The ``tensor_steps`` key of the JSON form."""
    return [
        {"candidate_run": t.candidate_run, "rank": t.rank, "first_step": t.first_step, "last_step": t.last_step,
         "modules": list(t.modules), "modules_unlisted": t.modules_unlisted, "max_rel_l2": _finite(t.max_rel_l2),
         "max_cosine": _finite(t.max_cosine)}
        for t in report.tensor_steps
    ]


def zoom_lines(report: pb.Report) -> list[str]:
    """Text lines: each zoom asked, then the steps each candidate rank compared with full tensors."""
    lines: list[str] = []
    if report.zooms:
        lines.append("zoom (live capture changes):")
        for w in report.zooms:
            spec = w.spec
            steps = (f"step {spec.first_step}" if spec.first_step == spec.last_step
                     else f"steps {spec.first_step}-{spec.last_step}")
            every = f" every {spec.every}" if spec.every > 1 else ""
            modules = ", ".join(spec.modules[:8]) + (f" (+{len(spec.modules) - 8})" if len(spec.modules) > 8 else "")
            bundle = f"; reproducer bundle of {spec.bundle_module!r}" if spec.bundle_module else ""
            if spec.ops_module:
                bundle += f"; the operations of {spec.ops_module!r}"
            lines.append(f"  #{spec.id} {w.origin}: {modules or '(model)'} in {spec.capture}"
                         f"{' + sketch' if spec.sketch else ''}, {steps}{every}{bundle} "
                         f"(told: {', '.join(w.runs) or 'no run'}){'' if w.state == 'sent' else ' ' + w.state}")
            if w.origin != "operator" and spec.reason:
                lines.append(f"     {spec.reason}")
    if report.tensor_steps:
        lines.append("steps compared with full tensors:")
        for t in report.tensor_steps:
            steps = f"step {t.first_step}" if t.first_step == t.last_step else f"steps {t.first_step}-{t.last_step}"
            more = f" (+{t.modules_unlisted})" if t.modules_unlisted else ""
            lines.append(f"  {t.candidate_run} rank {t.rank}, {steps}: {', '.join(t.modules[:6])}"
                         f"{' ...' if len(t.modules) > 6 else ''}{more}; worst rel_l2 {t.max_rel_l2:.3g}, "
                         f"cosine gap {t.max_cosine:.3g}")
    return lines


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")
