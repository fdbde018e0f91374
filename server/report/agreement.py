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
from twinstep.server.detect import drift
from twinstep.server.detect.evidence import CREATES
from twinstep.server.detect.origin import CLEAR_FORWARD
from twinstep.server.detect.stage import PARAM_GROWTH_PREMISE

_NUMBER = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan)"
_OVER = re.compile(rf"\((\w+) ({_NUMBER}) > (?:its faithful floor )?({_NUMBER})\)")
_BOUNDARY = re.compile(r"between the output gradients of '([^']*)' \(matches\) and '([^']*)' \(differs\)")
_ONE_FACTOR = re.compile(rf"every (output|parameter) gradient differs by the same factor x({_NUMBER}) "
                         r"\((\d+) of (\d+)\)")
_PARAMS_BEFORE = re.compile(rf"Parameters after step (\d+) were within tolerance, at up to ({_NUMBER}) of it")
_DATA = re.compile(r"^data: step (\d+) differs from its very first module \(([^)]*)\)")
_ERR = rf"(\w+) ({_NUMBER})"
_ORIGIN = re.compile(rf"^origin: (\S+) \(.*?\) creates the error: its input (?:matches exactly|is off by {_ERR}) and "
                     rf"its output is off by {_ERR} \(\w+ ({_NUMBER}) > (?:its faithful floor )?({_NUMBER})\), growth "
                     rf"(?:x({_NUMBER})|from exactly 0)")
_INHERITED = re.compile(rf"^inherited: the input of (\S+) is already off by {_ERR} \(its output by {_ERR}\)"
                        rf"(?:; (\S+), which ran before it, already differs by {_ERR})?")
_INPUT_MATCHES = re.compile(rf"^forward.*?: (\S+) \(.*?\) (?:is the first module whose output differs \("
                            rf"|differs while )its input matches \({_ERR}\)")
_INPUT_OFF = re.compile(rf"^forward.*?: (\S+) \(.*?\) is the first module over its tolerance, and its input is "
                        rf"already off by {_ERR} \(its output by {_ERR}\)")
_FORWARD_ORIGIN = re.compile(rf"its (\w+) error ({_NUMBER}) is ({_NUMBER})x the faithful floor of \w+ \w+ modules "
                             rf"at step (\d+) \(({_NUMBER})\)")
_UPDATE = re.compile(r"after the update (\d+) of (\d+) parameters differ")
_SIGN = re.compile(rf"^loss error (oscillates around 0|is biased to one side) \(mean signed / mean absolute = "
                   rf"({_NUMBER}); mean \|Δ\| at ({_NUMBER}) of its limit\)")
_STAGE_SOURCE = re.compile(rf"its input is already off by {_ERR} \(its output by {_ERR}\): the error arises before "
                           rf"it, in (\S+) or before it \(its output already differs by {_ERR}\)")
_CRITERION = re.compile(r"^(PASS|FAIL) (first loss|mean loss error|global grad norm|within the baseline's own noise): "
                        r"(.*)$")
#: A loss criterion's figures in its summary, and its limits: (absolute, relative, absolute limit, relative limit).
_LOSS_CRITERIA = {
    "first loss": ("first_loss_abs", "first_loss_rel", drift.FIRST_LOSS_ABS, drift.FIRST_LOSS_REL),
    "mean loss error": ("loss_mean_abs", "loss_mean_rel", drift.MEAN_LOSS_ABS, drift.MEAN_LOSS_REL),
}
_CRITERION_DETAIL = {
    "first loss": re.compile(rf"^\|Δ\| ({_NUMBER}), ({_NUMBER})% \(limit ({_NUMBER}) or ({_NUMBER})%\)$"),
    "mean loss error": re.compile(rf"^\|Δ\| ({_NUMBER}), ({_NUMBER})% over (\d+) steps \(limit ({_NUMBER}) or "
                                  rf"({_NUMBER})%\)$"),
    "global grad norm": re.compile(rf"^mean relative error ({_NUMBER})% \(limit ({_NUMBER})%\)$"),
    "within the baseline's own noise": re.compile(rf"^mean loss \|Δ\| ({_NUMBER}) vs ({_NUMBER}) x reference "
                                                  rf"({_NUMBER})(?:, floored at \w+ rounding ({_NUMBER}) \((\d+) x "
                                                  rf"({_NUMBER}) x mean loss ({_NUMBER})\))?$"),
}


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
            checks.extend(_stage_source(label, section))
    for summary in report.get("long_run", []):
        checks.extend(_long_run(f"long run {summary['candidate_run']}", summary))
        checks.extend(_criteria(f"long run {summary['candidate_run']}", summary))
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
        inp = float(m[3]) if m[3] is not None else 0.0
        outp, value, limit = float(m[5]), float(m[6]), float(m[7])
        check("origin", m[0], value > limit and inp * CREATES <= outp and _same_errors(row, outp, inp)
              and not stage.startswith("data") and "already off by" not in stage,
              f"input {inp} vs output {outp} (creating needs x{CREATES:g}), {value} vs {limit}, tree "
              f"{_errors_of(row)}, stage {stage[:40]!r}")
    if culprit.startswith("inherited from the data"):
        check("inherited from the data", culprit.split(":")[0], stage.startswith("data"),
              f"the stage is not data: {stage[:40]!r}")
    elif m := _INHERITED.search(culprit):
        row = rows.get(m[1])
        inp, outp = float(m[3]), float(m[5])
        source_ok = True
        if m[6] is not None:
            source = rows.get(m[6])
            source_ok = float(m[8]) * CREATES >= inp and (source is None or _same_errors(source, float(m[8]), None))
        check("inherited", m[0], inp * CREATES > outp and _same_errors(row, outp, inp) and source_ok
              and not stage.startswith("data") and "its input matches" not in stage,
              f"input {inp} vs output {outp}, tree {_errors_of(row)}, stage {stage[:60]!r}")
    if m := _INPUT_MATCHES.search(stage):
        row = rows.get(m[1])
        inp = float(m[3])
        error = _float(row["error"]) if row is not None and row.get("error") is not None else None
        check("input matches", m[0], _same_errors(row, None, inp) and (error is None or inp * CREATES <= error),
              f"tree {_errors_of(row)}")
    if m := _INPUT_OFF.search(stage):
        row = rows.get(m[1])
        inp, outp = float(m[3]), float(m[5])
        check("input already off", m[0], inp * CREATES > outp and _same_errors(row, outp, inp),
              f"input {inp} vs output {outp}, tree {_errors_of(row)}")
    if m := _FORWARD_ORIGIN.search(stage):
        value, ratio, step, floor = float(m[2]), float(m[3]), int(m[4]), float(m[5])
        check("forward origin", m[0], floor > 0 and math.isclose(value / floor, ratio, rel_tol=0.05, abs_tol=0.6)
              and ratio >= CLEAR_FORWARD and step == first["step"],
              f"{value} / {floor} is not {ratio} (or under {CLEAR_FORWARD:g}), or step {step} is not the divergence's")
    return out


def _same_errors(row: dict[str, Any] | None, output: float | None, given: float | None) -> bool:
    """Whether the tree row shows these errors (as printed, to 3 significant figures); True without a row or a
    field (an older report) to check them against."""
    if row is None:
        return True
    ok = True
    if output is not None and row.get("error") is not None:
        ok &= math.isclose(_float(row["error"]), output, rel_tol=6e-3, abs_tol=1e-300)
    if given is not None and row.get("input_error") is not None:
        ok &= math.isclose(_float(row["input_error"]), given, rel_tol=6e-3, abs_tol=1e-300)
    return ok


def _errors_of(row: dict[str, Any] | None) -> str:
    if row is None:
        return "(not in the tree)"
    return f"error {row.get('error')} input {row.get('input_error')}"


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


def _stage_source(label: str, section: dict[str, Any]) -> list[Check]:
    """The stage's "the error arises before it, in M or before it (its output already differs by E)": M ran
    before with an error of the input's order (at least 1/CREATES of it), shows E in the tree, and is the module
    the culprit line names too."""
    stage, culprit = section.get("stage") or "", section.get("culprit") or ""
    m = _STAGE_SOURCE.search(stage)
    if not m:
        return []
    rows = {(r["name"] or "(model)"): r for r in ((section.get("tree") or {}).get("rows") or [])}
    given, name, error = float(m[2]), m[5], float(m[7])
    module = section["first_divergence"]["module"] or "(model)"
    named = _INHERITED.search(culprit)
    culprit_source = named[6] if named is not None else None
    holds = (error * CREATES >= given and name != module and _same_errors(rows.get(name), error, None)
             and (culprit_source is None or culprit_source == name))
    why = (f"{name} (error {error}, tree {_errors_of(rows.get(name))}) against an input off by {given}; the culprit "
           f"names {culprit_source!r}")
    return [Check(label, "earlier source", m[0], holds, "" if holds else why)]


def _criteria(label: str, summary: dict[str, Any]) -> list[Check]:
    """Each PASS/FAIL line of a long-run summary: its figures are the summary's, its limits the criterion's, and
    PASS exactly when the figures are within them (twinstep.server.detect.drift)."""
    out = []
    for verdict in summary["verdicts"]:
        m = _CRITERION.search(verdict)
        d = _CRITERION_DETAIL[m[2]].search(m[3]) if m else None
        if d is None:
            continue
        passed = m[1] == "PASS"
        if m[2] in _LOSS_CRITERIA:
            abs_key, rel_key, abs_limit, rel_limit = _LOSS_CRITERIA[m[2]]
            actual = (_float(summary[abs_key]), _float(summary[rel_key]))
            printed = (float(d[1]), float(d[2]) / 100)
            limits = (abs_limit, rel_limit)
            printed_limits = (float(d[d.lastindex - 1]), float(d[d.lastindex]) / 100)
            within = actual[0] <= abs_limit or actual[1] <= rel_limit
            steps_ok = m[2] == "first loss" or int(d[3]) == summary["window"]
        elif m[2] == "global grad norm":
            actual, printed = (_float(summary["grad_norm_mean_rel"]),), (float(d[1]) / 100,)
            limits, printed_limits = (drift.GRAD_NORM_MEAN_REL,), (float(d[2]) / 100,)
            within, steps_ok = actual[0] <= limits[0], True
        else:  # within the baseline's own noise: a multiple of the reference rerun's mean loss error
            reference = summary.get("reference_loss_mean_abs")
            actual = (_float(summary["loss_mean_abs"]), _float(reference if reference is not None else "nan"))
            printed, limits, printed_limits = (float(d[1]), float(d[3])), (), ()
            band = float(d[2]) * actual[1]
            steps_ok = True
            if d[4] is not None:  # floored at float rounding: a floor its own factors give, over the band it replaces
                floor = float(d[4])
                steps_ok = _printed(floor, int(d[5]) * float(d[6]) * float(d[7])) and band < floor * (1 + 6e-3)
                band = floor
            within = actual[0] <= band
        holds = (all(_printed(p, a) for p, a in zip(printed, actual)) and steps_ok and passed == within
                 and all(_printed(p, a) for p, a in zip(printed_limits, limits)))
        out.append(Check(label, "long-run criterion", m[0], holds,
                         "" if holds else f"the summary's figures {actual} against limits {limits}: "
                                          f"{'within' if within else 'over'}"))
    return out


def _printed(printed: float, actual: float) -> bool:
    """Whether ``printed`` is ``actual`` as printed to 3 significant figures (NaN as NaN)."""
    if math.isnan(printed) or math.isnan(actual):
        return math.isnan(printed) and math.isnan(actual)
    return math.isclose(printed, actual, rel_tol=6e-3, abs_tol=1e-300)


def _float(value: Any) -> float:
    """A JSON number, or one of the words "inf", "-inf", "nan" the JSON form uses for them."""
    return float(value)
