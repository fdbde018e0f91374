"""A Report as people and programs read it: the documented JSON form (with its schema) and text.

Used by the command line, twinstep.compare and the embedded server handle; it reads only the
Report message, so any client of the server can render what the server says.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from twinstep.wire import phases
from twinstep.server.report.preflight import preflight_lines, preflight_to_dict
from twinstep.server.report.records import batch_sync_to_dict, record_lines, records_to_dict
from twinstep.server.report.zoom import tensor_steps_to_dict, zoom_lines, zooms_to_dict
from twinstep.server.report.operations import operation_lines, operations_to_dict
from twinstep.server.report.weights import weight_sync_lines, weight_sync_to_dict
from twinstep.v1 import twinstep_pb2 as pb


#: Version of the JSON form: the major number changes when a key is removed or changes meaning,
#: the minor number when keys are added.  The schema is ``report.schema.json`` beside this module.
SCHEMA_VERSION = "1.10"
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) that every ``report_to_dict`` result satisfies."""
    return json.loads(SCHEMA_PATH.read_text())


def report_to_dict(report: pb.Report) -> dict[str, Any]:
    """The documented JSON form of ``twinstep report --json`` (schema: :func:`report_schema`).

    Unknown figures (a noise band without a reference run, a growth factor
    without input evidence) are null; non-finite numbers are the strings
    "inf", "-inf" and "nan", since JSON has no such numbers.
    """
    first = _divergence(report.first_divergence) if report.HasField("first_divergence") else None
    tree = _tree(report.tree, first, _tree_step(report))
    return {
        "schema_version": SCHEMA_VERSION,
        "session": report.session,
        "status": report.status,
        "status_reasons": list(report.status_reasons),
        "halted": report.halted,
        "runs": [_run(r) for r in report.runs],
        "steps_compared": report.steps_compared,
        "first_divergence": first,
        "stage": report.stage or None,
        "culprit": report.culprit or None,
        "tree": tree,
        "candidates": [_candidate(c) for c in report.candidates],
        "long_run": [_long_run(summary) for summary in report.long_run],
        "headroom": [
            {"candidate_run": h.candidate_run, "phase": h.phase, "metric": h.metric, "value": _finite(h.value),
             "tolerance": _finite(h.tolerance), "step": h.step, "module": h.module, "dtype": h.dtype}
            for h in report.headroom
        ],
        "coverage": [
            {"candidate_run": c.candidate_run, "steps_compared": c.steps_compared,
             "compared": [[r.first, r.last] for r in c.compared], "gaps": [_gap(g) for g in c.gaps],
             "gaps_unlisted": c.gaps_unlisted, "declared": list(c.declared), "summary": c.summary}
            for c in report.coverage
        ],
        "unmatched": {"baseline": list(report.unmatched_baseline), "candidate": list(report.unmatched_candidate)},
        "proposed_mapping": report.proposed_mapping or None,
        "errors": list(report.errors),
        "records": records_to_dict(report),
        "batch_sync": batch_sync_to_dict(report),
        "zooms": zooms_to_dict(report),
        "tensor_steps": tensor_steps_to_dict(report),
        "operations": operations_to_dict(report),
        "preflight": preflight_to_dict(report),
        "layouts": {
            "mode": report.layout_mode or None,
            "summary": report.layout_summary,
            "differences": [{"run": d.run, "phase": d.phase, "name": d.name, "reason": d.reason,
                             "first_step": d.first_step, "steps": d.steps} for d in report.layout_differences],
            "replica_mismatches": [{"run": m.run, "step": m.step, "phase": m.phase, "name": m.name,
                                    "ranks": list(m.ranks), "agreeing": list(m.agreeing), "statistic": m.statistic,
                                    "value": _finite(m.value), "expected": _finite(m.expected), "text": m.text}
                                   for m in report.replica_mismatches],
        },
    }


def _divergence(d: pb.Divergence) -> dict[str, Any]:
    """A first divergence (the session's, or one candidate's)."""
    return {
        "step": d.step,
        "rank": d.rank,
        "phase": d.phase,
        "module": d.module,
        "candidate_module": d.candidate_module,
        "metric": d.metric,
        "value": _finite(d.value),
        "tolerance": _finite(d.tolerance),
        "candidate_run": d.candidate_run,
        "stage": d.stage,
        "after_gap": d.after_gap,
        "gaps_before": [_gap(g) for g in d.gaps_before],
        "gaps_summary": d.gaps_summary or None,
        "origin": _origin(d),
        "crossed": _crossed(d),
        "path": [{"step": p.step, "phase": p.phase, "module": p.module, "metric": p.metric, "error": _finite(p.error),
                  "input_error": _finite(p.input_error) if p.input_error >= 0 else None, "note": p.note}
                 for p in d.path],
        "explained_by": [{"category": f.category, "key": f.key, "baseline": f.baseline, "candidate": f.candidate,
                          "module": f.module, "message": f.message} for f in d.explained_by],
        "merged_from": d.merged_from or None,
    }


def origin_lines(d: pb.Divergence, indent: str = "  ") -> list[str]:
    """A traced-back divergence's evidence and where it first crossed a tolerance, in words ([] otherwise)."""
    if not d.HasField("origin"):
        return []
    o = d.origin
    more = f" (and {o.involved_total - len(o.involved)} more)" if o.involved_total > len(o.involved) else ""
    lines = [f"{indent}traced back to its origin, under every flat tolerance: {o.evidence}",
             f"{indent}involved: {', '.join(o.involved)}{more}"]
    if d.HasField("crossed"):
        c = d.crossed
        lines.append(f"{indent}first crossed a tolerance at step {c.step}, rank {c.rank}, {c.phase} of "
                     f"{c.module or '(model)'!r}: {c.metric} {c.value:.3g} > {c.tolerance:.3g}")
    else:
        lines.append(f"{indent}no tolerance crossed yet")
    if len(d.path) > 1:
        lines.append(f"{indent}path from the origin to the crossing (error on one scale; input's in brackets):")
        for p in d.path:
            given = f" (input {p.input_error:.3g})" if p.input_error >= 0 else ""
            lines.append(f"{indent}  step {p.step} {p.phase:<8} {p.module or '(model)'}: {p.metric} {p.error:.3g}"
                         f"{given}  {p.note}")
    return lines


def explained_lines(d: pb.Divergence, indent: str = "  ") -> list[str]:
    """Preflight findings the divergence goes through ([] when none)."""
    return [f"{indent}preflight explains it: {f.message} ({f.module or '(model)'} is on the diagnosis)"
            for f in d.explained_by]


def _origin(d: pb.Divergence) -> dict[str, Any] | None:
    if not d.HasField("origin"):
        return None
    o = d.origin
    return {"evidence": o.evidence, "rule": o.rule, "ratio": _finite(o.ratio), "evidence_step": o.evidence_step,
            "involved": list(o.involved), "involved_total": o.involved_total}


def _crossed(d: pb.Divergence) -> dict[str, Any] | None:
    if not d.HasField("crossed"):
        return None
    c = d.crossed
    return {"step": c.step, "rank": c.rank, "phase": c.phase, "module": c.module, "metric": c.metric,
            "value": _finite(c.value), "tolerance": _finite(c.tolerance)}


def _tree(rows: Any, first: dict[str, Any] | None, step: int | None = None) -> dict[str, Any] | None:
    """The module tree at a first divergence, else at the last step compared (``step`` when known)."""
    if not rows:
        return None
    return {
        "phase": first["phase"] if first else "forward",
        "step": first["step"] if first else step,
        "rows": [_row(r) for r in rows],
    }


def _candidate(c: pb.CandidateReport) -> dict[str, Any]:
    """One candidate's own section: its verdict and first divergence against the baseline."""
    first = _divergence(c.first_divergence) if c.HasField("first_divergence") else None
    return {
        "candidate_run": c.candidate_run,
        "framework": c.framework,
        "status": c.status,
        "status_reasons": list(c.status_reasons),
        "halted": c.halted,
        "steps_compared": c.steps_compared,
        "first_divergence": first,
        "stage": c.stage or None,
        "culprit": c.culprit or None,
        "tree": _tree(c.tree, first, c.tree_step if c.tree_step >= 0 else None),
        "coverage": c.coverage,
    }


def _gap(g: pb.Gap) -> dict[str, Any]:
    return {"run": g.run, "rank": g.rank, "first_step": g.first_step, "last_step": g.last_step,
            "phase": g.phase or None, "reason": g.reason}


def _run(r: pb.RunStatus) -> dict[str, Any]:
    return {
        "name": r.name,
        "baseline": r.baseline,
        "reference": r.reference,
        "framework": r.framework,
        "ranks": r.ranks,
        "first_step": r.first_step,
        "last_step": r.last_step,
        "state": r.state,
        "dropped": r.dropped,
        "dropped_by_reason": dict(r.dropped_by_reason),
        "records_received": r.records_received,
        "steps_resent": r.steps_resent,
        "capture_cost": _cost(r.capture_cost),
        "environment": dict(r.environment),
        "warnings": list(r.warnings),
        "weight_sync": weight_sync_to_dict(r),
        "layout": ({"data_size": r.layout.data_size, "tensor_size": r.layout.tensor_size,
                    "pipeline_size": r.layout.pipeline_size, "context_size": r.layout.context_size,
                    "expert_size": r.layout.expert_size, "source": r.layout.source, "text": r.layout_text}
                   if r.HasField("layout") else None),
        "capture_health": [
            {
                "rank": h.rank,
                "failed_steps": h.capture.failed_steps,
                "first_failed_step": h.capture.first_failed_step if h.capture.failed_steps else None,
                "last_failed_step": h.capture.last_failed_step if h.capture.failed_steps else None,
                "step_error": h.capture.step_error or None,
                "failures": [
                    {"phase": phases.describe(f.phase), "name": f.name, "count": f.count,
                     "first_step": f.first_step, "last_step": f.last_step, "error": f.error}
                    for f in h.capture.failures
                ],
                "dropped": dict(h.capture.dropped),
            }
            for h in r.health
        ],
    }


def _cost(c: pb.CaptureCost) -> dict[str, Any] | None:
    if not c.steps:
        return None  # an older client, or no step received
    return {"steps": c.steps, "bytes_captured": c.bytes_captured, "bytes_read": c.bytes_read,
            "stats_offloaded": c.stats_offloaded, "stats_inline": c.stats_inline,
            "boundary_seconds": c.boundary_us / 1e6}


def describe_cost(c: pb.CaptureCost) -> str:
    """One line: bytes read against bytes captured per step, and where the statistics ran."""
    per_step = 1.0 / c.steps
    passes = c.stats_offloaded + c.stats_inline
    off = f", {100.0 * c.stats_offloaded / passes:.0f}% of statistics off the training thread" if passes else ""
    return (f"read {c.bytes_read * per_step / 1e6:.1f} MB of {c.bytes_captured * per_step / 1e6:.1f} MB captured "
            f"per step{off}, step-boundary wait {c.boundary_us * per_step / 1e3:.1f} ms")


def _row(r: pb.ModuleRow) -> dict[str, Any]:
    return {
        "name": r.name,
        "type": r.type,
        "candidate_name": r.candidate_name,
        "metric": r.metric,
        "value": _finite(r.value),
        "tolerance": _finite(r.tolerance),
        "divergent": r.divergent,
        "first": r.first,
        "compared": r.compared,
        "noise": _finite(r.noise) if r.noise >= 0 else None,
        "growth": _finite(r.growth) if r.growth >= 0 else None,
        "error_metric": r.error_metric or None,
        "error": _finite(r.error) if r.error_metric else None,
        "input_error_metric": r.input_error_metric or None,
        "input_error": _finite(r.input_error) if r.input_error >= 0 else None,
    }


def _long_run(summary: pb.LongRun) -> dict[str, Any]:
    with_reference = summary.reference_loss_mean_abs >= 0
    return {
        "candidate_run": summary.candidate_run,
        "steps": summary.steps,
        "window": summary.window,
        "first_loss_abs": _finite(summary.first_loss_abs),
        "first_loss_rel": _finite(summary.first_loss_rel),
        "loss_mean_abs": _finite(summary.loss_mean_abs),
        "loss_mean_rel": _finite(summary.loss_mean_rel),
        "loss_mean_signed": _finite(summary.loss_mean_signed),
        "grad_norm_mean_rel": _finite(summary.grad_norm_mean_rel),
        "reference_loss_mean_abs": _finite(summary.reference_loss_mean_abs) if with_reference else None,
        "reference_grad_norm_mean_rel": _finite(summary.reference_grad_norm_mean_rel) if with_reference else None,
        "verdicts": list(summary.verdicts),
        "coverage": summary.coverage,
    }


def _finite(value: float) -> float | str:
    """JSON has no Infinity: say it in words."""
    return value if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")


def render_text(report: pb.Report) -> str:
    """Human-readable report: verdict, runs, and the module tree with the culprit marked."""
    lines = [f"session {report.session!r}: {report.status.upper()}" + ("  (halted)" if report.halted else "")]
    if report.replica_mismatches:  # the verdict compares runs; this is within one run, and just as serious
        runs = sorted({m.run for m in report.replica_mismatches})
        lines[0] += f"  (but replicas disagree within run {', '.join(map(repr, runs))}: see below)"
    for r in report.runs:
        role = "baseline " if r.baseline else "reference" if r.reference else "candidate"
        version = r.environment.get(r.framework, "")
        lines.append(
            f"  {role} {r.name:<12} {r.framework:<7}{(' ' + version) if version else ''}  ranks {r.ranks}  "
            f"last step {r.last_step:<5} {r.state}"
            + (f"  dropped {r.dropped}" if r.dropped else "")
            + ("  CAPTURE FAILING" if any(h.capture.failures or h.capture.failed_steps for h in r.health) else "")
        )
        if r.layout_text and (r.layout_text != "1 rank" or report.layout_mode == "logical"):
            lines.append(f"    layout: {r.layout_text}")
        if r.capture_cost.steps:
            lines.append(f"    capture: {describe_cost(r.capture_cost)}")
        lines.extend(weight_sync_lines(r))
    if report.layout_mode == "logical" or report.layout_differences:
        lines.append(f"  lined up: {report.layout_summary}")
    lines.append(f"  steps compared: {report.steps_compared}")
    if report.status_reasons:
        heading = "not compared" if report.status == "incomplete" else "coverage"
        lines.append(f"  {heading}:")
        lines.extend(f"    - {reason}" for reason in report.status_reasons)
    warnings = [(r.name, w) for r in report.runs for w in r.warnings]
    for name, warning in warnings:
        lines.append(f"  warning, run {name!r}: {warning}")
    if report.preflight:
        lines.extend("  " + line for line in preflight_lines(report))
    several = len(report.candidates) > 1
    if several:  # one section per candidate; the session's earliest divergence is one of them
        for candidate in report.candidates:
            lines.append("")
            lines.extend(_candidate_lines(candidate))
    else:
        first = report.first_divergence if report.HasField("first_divergence") else None
        lines.extend(_divergence_lines(first, report.stage, report.culprit, report.tree, _tree_step(report)))
    if report.coverage and not several:
        lines.append("")
        for coverage in report.coverage:
            lines.append(f"coverage, candidate {coverage.candidate_run!r}: {coverage.summary}")
    for summary in report.long_run:
        lines.append("")
        lines.append(f"long run, candidate {summary.candidate_run!r}: {summary.steps} steps compared, "
                     f"criteria over the last {summary.window}:")
        if summary.coverage:
            lines.append(f"  ({summary.coverage})")
        lines.extend(f"  {verdict}" for verdict in summary.verdicts)
        diverged = divergence_of(report, summary.candidate_run)
        if diverged is not None:
            lines.append(f"  {long_run_scope(diverged)}")
    if report.headroom:
        lines.append("")
        lines.extend(_headroom_lines(report.headroom))
    if report.records or report.HasField("batch_sync"):
        lines.append("")
        lines.extend(record_lines(report))
    if report.zooms or report.tensor_steps:
        lines.append("")
        lines.extend(zoom_lines(report))
    if report.operations:
        lines.append("")
        lines.extend(operation_lines(report))
    if report.unmatched_baseline or report.unmatched_candidate:
        lines.append("")
        if report.unmatched_baseline:
            lines.append("baseline records with no candidate counterpart: " + ", ".join(report.unmatched_baseline[:20]))
        if report.unmatched_candidate:
            lines.append("candidate records with no baseline counterpart: " + ", ".join(report.unmatched_candidate[:20]))
    lines.extend(layout_lines(report))
    for error in report.errors[:20]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def layout_lines(report: pb.Report) -> list[str]:
    """Replicas that disagree, and records a difference of layout kept out of the comparison."""
    lines: list[str] = []
    if report.replica_mismatches:
        lines.append("")
        lines.append("replicas that should be identical and are not (found within one run, no baseline needed):")
        lines.extend(f"  - {m.text}" for m in report.replica_mismatches[:20])
    if report.layout_differences:
        lines.append("")
        lines.append("not compared, because the runs' layouts differ (layout differences, not divergences):")
        for d in report.layout_differences[:20]:
            seen = f"step {d.first_step}" + (f" and {d.steps - 1} more" if d.steps > 1 else "")
            lines.append(f"  - {d.phase} of {d.name!r} in run {d.run!r} ({seen}): {d.reason}")
        if len(report.layout_differences) > 20:
            lines.append(f"  ... and {len(report.layout_differences) - 20} more (see the JSON report)")
    return lines


def _tree_step(report: pb.Report) -> int | None:
    """The step of the session's tree when no divergence gives it: its only candidate's (None: not known)."""
    if len(report.candidates) == 1 and report.candidates[0].tree_step >= 0:
        return report.candidates[0].tree_step
    return None


def divergence_of(report: pb.Report, run: str) -> pb.Divergence | None:
    """Candidate ``run``'s first divergence (None: it has none)."""
    for c in report.candidates:
        if c.candidate_run == run:
            return c.first_divergence if c.HasField("first_divergence") else None
    first = report.first_divergence if report.HasField("first_divergence") else None
    return first if first is not None and first.candidate_run == run else None


def long_run_scope(d: pb.Divergence) -> str:
    """What long-run criteria mean beside a divergence: they judge the loss and gradient norm only."""
    return (f"these criteria judge only the loss and the global gradient norm: the divergence above "
            f"(step {d.step}, {d.phase} of {d.module or '(model)'!r}) stands")


def _candidate_lines(c: pb.CandidateReport) -> list[str]:
    """One candidate's section: a heading with its verdict, its first divergence and tree, its coverage."""
    halted = "  (halted)" if c.halted else ""
    lines = [f"== candidate {c.candidate_run!r} ({c.framework}) against the baseline: {c.status.upper()}{halted}, "
             f"{c.steps_compared} step(s) compared"]
    if c.status_reasons and c.status != "aligned":
        lines.extend(f"  - {reason}" for reason in c.status_reasons)
    first = c.first_divergence if c.HasField("first_divergence") else None
    tree_step = c.tree_step if c.tree_step >= 0 else None
    lines.extend(line for line in _divergence_lines(first, c.stage, c.culprit, c.tree, tree_step) if line)
    if c.coverage:
        lines.append(f"coverage: {c.coverage}")
    return lines


def _divergence_lines(d: pb.Divergence | None, stage: str, culprit: str, tree: Any,
                      tree_step: int | None) -> list[str]:
    """A first divergence (None: none) with its stage and culprit, then the module tree around it."""
    lines: list[str] = []
    if d is not None:
        where = d.module or "(model)"
        also = f" (candidate {d.candidate_module!r})" if d.candidate_module and d.candidate_module != d.module else ""
        lines.append("")
        rank = "every rank merged" if d.merged_from else f"rank {d.rank}"
        lines.append(
            f"first divergence: step {d.step}, {rank}, {d.phase} of {where!r}{also} "
            f"in run {d.candidate_run!r}: {d.metric} {d.value:.3g} > "
            f"{'faithful floor' if d.HasField('origin') else 'tolerance'} {d.tolerance:.3g}"
        )
        if d.merged_from:
            lines.append(f"  merged per logical tensor: {d.merged_from}")
        lines.extend(origin_lines(d))
        lines.extend(explained_lines(d))
        if d.after_gap:
            lines.append("  after a gap: this is the earliest divergence among the steps compared, and it may have")
            lines.append("  begun where nothing was compared: " + d.gaps_summary)
        lines.append(f"stage: {stage}")
        if culprit:
            lines.append(f"culprit: {culprit}")
    if tree:
        phase = d.phase if d is not None else "forward"
        phase = "named" if phase == "record" else phase  # "named records", not "record records"
        lines.append("")
        step = d.step if d is not None else tree_step
        lines.append(f"{phase} records, {'the last step compared' if step is None else f'step {step}'}:")
        lines.extend(_tree_lines(tree))
    return lines


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
        for phase in (p for p in phases.STEP_ORDER if (run, p) in closest):
            ratio, h = closest[(run, phase)]
            share = f"{ratio:6.3f} of it" if math.isfinite(ratio) else "no tolerance"
            out.append(f"  {phase:<8} {h.metric:<8} {h.value:9.2e} / {h.tolerance:8.1e}  {share}  "
                       f"({h.module or '(model)'}, step {h.step}, {h.dtype})")
    return out


#: Below the tree: what its columns of errors are.
TREE_LEGEND = "growth: output error over input error; err: the record's error on one scale; in: its module input's"


def _tree_lines(rows: Any) -> list[str]:
    """A header naming each column, a line per module, and the legend of the error columns."""
    labels = _labels([r.name for r in rows])
    width = max(len("module"), *(len(label) for label in labels))
    with_noise = any(r.noise >= 0 for r in rows)
    with_errors = any(r.error_metric for r in rows)
    # Each heading starts where its column's text does on the rows below it.
    out = [f"  {'module':<{width}}  {'type':<18} {'metric':<9} {'value / tolerance':<20}"
           + (f"  {'noise':<14}" if with_noise else "") + f"  {'growth':<9}"
           + (f"  {'err':<12} {'in':<11}" if with_errors else "") + "  verdict"]
    for r, label in zip(rows, labels):
        verdict = "DIVERGED" if r.divergent else "ok"
        marker = "  <== first divergence" if r.first else ""
        noise = (f"  noise {r.noise:8.1e}" if r.noise >= 0 else "  noise        -") if with_noise else ""
        growth = f"  x{r.growth:<8.3g}" if r.growth >= 0 else "           "
        if r.error_metric:
            growth += f"  err {r.error:8.2e}" + (f" in {r.input_error:8.2e}" if r.input_error >= 0 else " " * 12)
        elif with_errors:
            growth += " " * 26
        out.append(
            f"  {label:<{width}}  {r.type[:18]:<18} {r.metric:<9} {r.value:9.2e} / {r.tolerance:8.1e}{noise}{growth}  {verdict}{marker}"
        )
    out.append(f"  {TREE_LEGEND}" if with_errors else "  growth: output error over input error")
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
