"""Render a session Report (from the server or an embedded handle) as JSON or text."""

from __future__ import annotations

import math
from typing import Any

from twinstep.v1 import twinstep_pb2 as pb


def report_to_dict(report: pb.Report) -> dict[str, Any]:
    """The documented JSON form of ``twinstep report --json``."""
    first = None
    if report.HasField("first_divergence"):
        d = report.first_divergence
        first = {
            "step": d.step,
            "rank": d.rank,
            "phase": d.phase,
            "module": d.module,
            "candidate_module": d.candidate_module,
            "metric": d.metric,
            "value": _finite(d.value),
            "tolerance": _finite(d.tolerance),
        }
    return {
        "session": report.session,
        "status": report.status,
        "halted": report.halted,
        "runs": [
            {
                "name": r.name,
                "baseline": r.baseline,
                "framework": r.framework,
                "ranks": r.ranks,
                "last_step": r.last_step,
                "state": r.state,
                "dropped": r.dropped,
            }
            for r in report.runs
        ],
        "steps_compared": report.steps_compared,
        "first_divergence": first,
    }


def _finite(value: float) -> float | str:
    """JSON has no Infinity: say it in words."""
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")


def render_text(report: pb.Report) -> str:
    """Human-readable report: verdict, runs, and the module tree with the culprit marked."""
    lines = [f"session {report.session!r}: {report.status.upper()}" + ("  (halted)" if report.halted else "")]
    for r in report.runs:
        role = "baseline " if r.baseline else "candidate"
        lines.append(
            f"  {role} {r.name:<12} {r.framework:<7} ranks {r.ranks}  last step {r.last_step:<5} "
            f"{r.state}" + (f"  dropped {r.dropped}" if r.dropped else "")
        )
    lines.append(f"  steps compared: {report.steps_compared}")
    if report.HasField("first_divergence"):
        d = report.first_divergence
        where = d.module or "(model)"
        also = f" (candidate {d.candidate_module!r})" if d.candidate_module and d.candidate_module != d.module else ""
        lines.append("")
        lines.append(
            f"first divergence: step {d.step}, rank {d.rank}, {d.phase} of {where!r}{also} "
            f"in run {d.candidate_run!r}: {d.metric} {d.value:.3g} > tolerance {d.tolerance:.3g}"
        )
        lines.append(f"stage: {report.stage}")
        if report.culprit:
            lines.append(f"culprit: {report.culprit}")
    if report.tree:
        phase = report.first_divergence.phase if report.HasField("first_divergence") else "forward"
        lines.append("")
        lines.append(f"{phase} records, step {report.first_divergence.step if report.HasField('first_divergence') else 'last compared'}:")
        lines.extend(_tree_lines(report.tree))
    for summary in report.long_run:
        lines.append("")
        lines.append(f"long run, candidate {summary.candidate_run!r}: {summary.steps} steps compared, "
                     f"criteria over the last {summary.window}:")
        lines.extend(f"  {verdict}" for verdict in summary.verdicts)
    if report.headroom:
        lines.append("")
        lines.extend(_headroom_lines(report.headroom))
    if report.unmatched_baseline or report.unmatched_candidate:
        lines.append("")
        if report.unmatched_baseline:
            lines.append("baseline records with no candidate counterpart: " + ", ".join(report.unmatched_baseline[:20]))
        if report.unmatched_candidate:
            lines.append("candidate records with no baseline counterpart: " + ", ".join(report.unmatched_candidate[:20]))
    for error in report.errors[:20]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def _headroom_lines(headroom: Any) -> list[str]:
    """Per candidate and phase, the metric that came closest to its tolerance."""
    closest: dict[tuple[str, str], Any] = {}
    for h in headroom:
        ratio = h.value / h.tolerance if h.tolerance > 0 else math.inf
        key = (h.candidate_run, h.phase)
        if key not in closest or ratio > closest[key][0]:
            closest[key] = (ratio, h)
    out = []
    for run in dict.fromkeys(h.candidate_run for h in headroom):
        out.append(f"worst value against its tolerance per phase, candidate {run!r} (over every step compared):")
        phases = [p for p in ("forward", "loss", "backward", "grad", "param") if (run, p) in closest]
        for phase in phases:
            ratio, h = closest[(run, phase)]
            share = f"{ratio:6.3f} of it" if math.isfinite(ratio) else "no tolerance"
            out.append(f"  {phase:<8} {h.metric:<8} {h.value:9.2e} / {h.tolerance:8.1e}  {share}  "
                       f"({h.module or '(model)'}, step {h.step}, {h.dtype})")
    return out


def _tree_lines(rows: Any) -> list[str]:
    labels = _labels([r.name for r in rows])
    width = max(len(label) for label in labels)
    with_noise = any(r.noise >= 0 for r in rows)
    out = []
    for r, label in zip(rows, labels):
        verdict = "DIVERGED" if r.divergent else "ok"
        marker = "  <== first divergence" if r.first else ""
        noise = (f"  noise {r.noise:8.1e}" if r.noise >= 0 else "  noise        -") if with_noise else ""
        growth = f"  x{r.growth:<8.3g}" if r.growth >= 0 else "           "
        out.append(
            f"  {label:<{width}}  {r.type[:18]:<18} {r.metric:<9} {r.value:9.2e} / {r.tolerance:8.1e}{noise}{growth}  {verdict}{marker}"
        )
    return out


def _labels(names: list[str]) -> list[str]:
    """Indented labels relative to the nearest ancestor that has a row of its own."""
    shown = set(names)
    depth: dict[str, int] = {}
    labels = []
    for name in names:
        if not name:
            depth[name] = 0
            labels.append("(model)")
            continue
        parent = name
        while True:
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
            if parent in shown or not parent:
                break
        level = depth.get(parent, 0) + 1 if parent in shown else 0
        depth[name] = level
        relative = name[len(parent) + 1 :] if parent else name
        labels.append("  " * level + relative)
    return labels
