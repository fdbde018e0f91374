"""The report's account of live capture control: the zooms asked, whether each ran (on which runs and steps, or
why not), and the steps that got full tensors."""

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
         "reason": w.spec.reason, "runs": list(w.runs), "state": w.state, "ops_module": w.spec.ops_module or None,
         "captured": [{"run": c.run, "first_step": c.first_step, "last_step": c.last_step} for c in w.captured],
         "outcome": outcome(report, w)}
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


def what_words(spec: pb.ZoomSpec) -> str:
    """What a window asks: "layers.1.mlp in tensors", "the whole model in tensors", "the operations of 'x'"."""
    if spec.ops_module and not spec.modules:
        return f"the operations of {spec.ops_module!r}"
    modules = ", ".join(m or "the whole model" for m in spec.modules[:8])
    more = f" (+{len(spec.modules) - 8})" if len(spec.modules) > 8 else ""
    return f"{modules}{more} in {spec.capture}{' + sketch' if spec.sketch else ''}"


def outcome(report: pb.Report, window: pb.ZoomWindow) -> str:
    """Whether a zoom ran, on which runs and steps, or why not, in words (the runs as the report lists them)."""
    if window.state != "sent":
        return window.state
    spec, runs = window.spec, {r.name: r for r in report.runs}
    order = [r.name for r in report.runs]
    captured = {c.run: (c.first_step, c.last_step) for c in window.captured}
    ran = sorted(captured, key=lambda run: order.index(run) if run in order else len(order))
    missed = sorted((run for run in window.runs if run not in captured),
                    key=lambda run: order.index(run) if run in order else len(order))
    if not ran and not missed:
        return "never ran: no run was streaming when it was asked"
    why = {run: _missed(runs.get(run), spec) for run in missed}
    if ran:
        if len(set(captured.values())) == 1:
            words = f"ran on {' and '.join(ran)}, {_steps(*captured[ran[0]])}"
        else:
            words = "ran on " + " and ".join(f"{run} ({_steps(*captured[run])})" for run in ran)
        return words + "".join(f"; not on {run}: it {reason}" for run, reason in why.items())
    if all(reason.startswith("had ended after") for reason in why.values()):
        return (f"never ran: every run had ended before step {spec.first_step} ("
                + ", ".join(f"{run} after step {runs[run].last_step}" for run in missed) + ")")
    running = any(runs.get(run) is not None and runs[run].state == "streaming" for run in missed)
    return ("not run yet: " if running else "never ran: ") + "; ".join(
        f"{run} {reason}" for run, reason in why.items())


def _missed(run: pb.RunStatus | None, spec: pb.ZoomSpec) -> str:
    """Why ``run``, told, delivered no step of the window with what it asked."""
    if run is not None and run.last_step < spec.first_step:
        if run.state == "streaming":
            return f"has not reached step {spec.first_step}"
        return f"had ended after step {run.last_step}"
    steps = "that step" if spec.first_step == spec.last_step else "those steps"
    return f"sent {steps} without what the zoom asked"


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def zoom_lines(report: pb.Report) -> list[str]:
    """Text lines: each zoom asked and whether it ran, then the steps each candidate rank compared with full tensors."""
    lines: list[str] = []
    if report.zooms:
        lines.append("zoom (live capture changes):")
        for w in report.zooms:
            spec = w.spec
            what = what_words(spec)
            if w.state == "sent":
                every = f" every {spec.every}" if spec.every > 1 else ""
                bundle = f"; reproducer bundle of {spec.bundle_module!r}" if spec.bundle_module else ""
                if spec.ops_module and spec.modules:
                    bundle += f"; the operations of {spec.ops_module!r}"
                told = ", ".join(w.runs) or "no run"
                what += f", {_steps(spec.first_step, spec.last_step)}{every}{bundle} (told: {told})"
            lines.append(f"  #{spec.id} {w.origin}: {what}")
            if w.origin != "operator" and spec.reason:
                lines.append(f"     {spec.reason}")
            lines.append(f"     {outcome(report, w)}")
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
