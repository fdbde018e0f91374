"""Do a report's words agree with its numbers?  Each stage, culprit and long-run sentence against the figures
printed beside it (the first divergence, the module tree, the long-run summary).

For tests and benchmarks/localization.py: ``check_words(report)`` lists every sentence it knows how to check,
with whether its premise holds and why not; ``words_agree(report)`` is True when none fails.  It reads the
documented JSON form (``report_to_dict``), or a Report message, which it renders to that form first, so it
sees what a user sees.  A sentence it has no rule for is not listed: the rules cover the sentences of
twinstep.server.detect.stage, .culprit and .drift.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from twinstep.server.detect.drift import BIAS_MIN_STEPS, BIAS_PREMISE, loss_error_share
from twinstep.server.detect.stage import PARAM_GROWTH_PREMISE

_NUMBER = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan)"
_OVER = re.compile(rf"\((\w+) ({_NUMBER}) > ({_NUMBER})\)")
_BOUNDARY = re.compile(r"between the output gradients of '([^']*)' \(matches\) and '([^']*)' \(differs\)")
_ONE_FACTOR = re.compile(rf"every (output|parameter) gradient differs by the same factor x({_NUMBER}) "
                         r"\((\d+) of (\d+)\)")
_PARAMS_BEFORE = re.compile(rf"Parameters after step (\d+) were within tolerance, at up to ({_NUMBER}) of it")
_DATA = re.compile(r"^data: step (\d+) differs from its very first module \(([^)]*)\)")
_ORIGIN = re.compile(rf"^origin: (\S+) \(.*?\) creates the error: its input matches \((\w+) ({_NUMBER})\) and its "
                     rf"output does not \(\w+ ({_NUMBER}) > ({_NUMBER})\), growth (?:x({_NUMBER})|from exactly 0)")
_UPDATE = re.compile(r"after the update (\d+) of (\d+) parameters differ")
_SIGN = re.compile(rf"^loss error (oscillates around 0|is biased to one side) \(mean signed / mean absolute = "
                   rf"({_NUMBER}); mean \|Δ\| at ({_NUMBER}) of its limit\)")


@dataclass(frozen=True)
class Check:
    """One sentence (or clause) of a report, and whether the numbers beside it bear it out."""

    section: str
    """"report", "candidate <run>" or "long run <run>"."""
    kind: str
    text: str
    holds: bool
    why: str = ""


def check_words(report: Any) -> list[Check]:
    """Every checkable stage, culprit and long-run sentence of ``report`` (a Report or its JSON form)."""
    if not isinstance(report, dict):
        from twinstep.server.report.render import report_to_dict

        report = report_to_dict(report)
    checks: list[Check] = []
    sections = [("report", report)] + [(f"candidate {c['candidate_run']}", c) for c in report.get("candidates", [])]
    for label, section in sections:
        if section.get("first_divergence"):
            checks.extend(_divergence(label, section))
    for summary in report.get("long_run", []):
        checks.extend(_long_run(f"long run {summary['candidate_run']}", summary))
    return checks


def words_agree(report: Any) -> bool:
    """True when no sentence of the report states what its numbers contradict."""
    return all(c.holds for c in check_words(report))


def _divergence(label: str, section: dict[str, Any]) -> list[Check]:
    first = section["first_divergence"]
    stage, culprit = section.get("stage") or "", section.get("culprit") or ""
    rows = {(r["name"] or "(model)"): r for r in ((section.get("tree") or {}).get("rows") or [])}
    module = first["module"] or "(model)"
    out: list[Check] = []

    def check(kind: str, text: str, holds: bool, why: str) -> None:
        out.append(Check(label, kind, text, bool(holds), "" if holds else why))

    for text in (stage, culprit):
        for metric, value, limit in _OVER.findall(text):
            check("over tolerance", f"({metric} {value} > {limit})", float(value) > float(limit),
                  f"{value} is not over {limit}")
    if m := _BOUNDARY.search(stage):
        before = rows.get(m[1])
        check("backward boundary", m[0], (before is None or not before["divergent"]) and m[2] == module,
              f"{m[1]!r} is DIVERGED in the tree" if before is not None and before["divergent"]
              else f"the first divergence is {module!r}, not {m[2]!r}")
    if m := _ONE_FACTOR.search(stage):
        phase = "backward" if m[1] == "output" else "grad"
        matching = list(rows.values()) if first["phase"] == phase else []
        ok = [r for r in matching if r["divergent"]]
        factor = float(m[2])
        check(f"one factor ({phase})", m[0],
              first["phase"] == phase and len(ok) == len(matching) and m[3] == m[4] and factor != 1.0
              and len(matching) <= int(m[4]),
              f"{len(matching) - len(ok)} of the tree's {len(matching)} {phase} rows match")
    if m := _PARAMS_BEFORE.search(stage):
        ratio = float(m[2])
        check("parameters before", m[0],
              PARAM_GROWTH_PREMISE <= ratio <= 1.0 and int(m[1]) == first["step"] - 1
              and " by the same factor " not in stage,
              f"at {ratio} of tolerance (premise: {PARAM_GROWTH_PREMISE} to 1), or beside a one-factor cause")
    if m := _DATA.search(stage):
        check("data", m[0], first["phase"] == "forward" and int(m[1]) == first["step"] and m[2] == module,
              f"the first divergence is step {first['step']}, {first['phase']} of {module!r}")
    if m := _UPDATE.search(stage):
        params = list(rows.values()) if first["phase"] == "param" else []
        if len(params) == int(m[2]):  # the whole phase is in the tree
            diverged = sum(r["divergent"] for r in params)
            check("parameters updated", m[0], diverged == int(m[1]), f"the tree has {diverged} DIVERGED")
    if m := _ORIGIN.search(culprit):
        row = rows.get(m[1])
        inp, outp, limit = float(m[3]), float(m[4]), float(m[5])
        growth = row.get("growth") if row is not None else None
        growth_ok = growth is None or inp == 0 or math.isclose(_float(growth), outp / inp, rel_tol=5e-3)
        check("origin", m[0], outp > limit and growth_ok and not stage.startswith("data")
              and "already differs" not in stage,
              f"output {outp} vs {limit}, tree growth {growth}, stage {stage[:40]!r}")
    if culprit.startswith("inherited from the data"):
        check("inherited from the data", culprit.split(":")[0], stage.startswith("data"),
              f"the stage is not data: {stage[:40]!r}")
    elif culprit.startswith("inherited:"):
        check("inherited", "functional operations in the parent's forward",
              not stage.startswith("data") and "its input matches" not in stage,
              f"the stage says otherwise: {stage[:60]!r}")
    return out


def _long_run(label: str, summary: dict[str, Any]) -> list[Check]:
    out = []
    for verdict in summary["verdicts"]:
        m = _SIGN.search(verdict)
        if not m:
            continue
        mean_abs, mean_rel, signed = (_float(summary[k])
                                      for k in ("loss_mean_abs", "loss_mean_rel", "loss_mean_signed"))
        share = loss_error_share(mean_abs, mean_rel)
        bias = abs(signed) / mean_abs if mean_abs > 0 else math.nan
        biased = m[1] != "oscillates around 0"
        holds = (mean_abs > 0 and share >= BIAS_PREMISE and math.isclose(share, float(m[3]), abs_tol=0.006)
                 and biased == (bias >= 0.5) and summary["window"] >= BIAS_MIN_STEPS)
        out.append(Check(label, "loss error sign", m[0], holds,
                         "" if holds else f"mean |Δ| {mean_abs:.3g} at {share:.3g} of its limit "
                                          f"(premise >= {BIAS_PREMISE}), bias {bias:.2f}"))
    return out


def _float(value: Any) -> float:
    """A JSON number, or one of the words "inf", "-inf", "nan" the JSON form uses for them."""
    return float(value)
