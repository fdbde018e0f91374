"""Origin or inheritance: does a forward divergence's module create its error, or receive it?

Each module's first input is captured too (cheaply: it is usually another
module's output).  Input and output are judged on one scale
(twinstep.server.detect.evidence): a module whose output error is at least
``evidence.CREATES`` times its input's creates the error; one whose input
already carries an error of that order inherits it, from the data (the first
module to run in the step), from a hooked module that ran before it (its
output is already off by as much), or else from code no hook sees
(functional operations in a parent's forward).  The stage
(twinstep.server.detect.stage) and the culprit line both read this one
classification, so they cannot say different things.
"""

from __future__ import annotations

from dataclasses import dataclass

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect import evidence
from twinstep.server.detect.evidence import Error


@dataclass(frozen=True)
class Forward:
    """How a forward record came by its error."""

    kind: str
    """"creates", "data", "inherited" (from ``source``), "unhooked" (code between hooks), "no input"."""
    output: Error
    given: Error | None
    """The error of the module's captured input; None when not captured."""
    first_to_run: bool
    source: str = ""
    """For "inherited": the hooked module that ran before and whose output already carries the error."""
    source_error: Error | None = None


def classify(row: Row, comparison: StepComparison) -> Forward:
    """The one reading of a forward record that the stage and the culprit both state."""
    k = comparison.rows.index(row)
    output = evidence.error_at(comparison, k)
    given = evidence.input_error(comparison, row)
    first_to_run = next((r for r in comparison.rows if r.phase == "forward"), None) is row
    if given is None:
        return Forward("no input", output, None, first_to_run)
    if evidence.creates(output.value, given.value):
        return Forward("creates", output, given, first_to_run)
    if first_to_run and any(r.divergent for r in evidence.input_rows(comparison, row)):
        return Forward("data", output, given, first_to_run)
    source, source_error = _earlier_source(comparison, k, given.value)
    if source is not None:
        return Forward("inherited", output, given, first_to_run, source, source_error)
    return Forward("unhooked", output, given, first_to_run)


def _earlier_source(comparison: StepComparison, k: int, given: float) -> tuple[str | None, Error | None]:
    """The first hooked module that ran before record ``k`` whose output already carries an error of the
    input's order (at least 1/CREATES of it); (None, None) when every earlier output is far below it."""
    worst, which = evidence.errors(comparison)
    inside = comparison.rows[k].name + "."  # its children ran before it ended, but after its input was taken
    for j, r in enumerate(comparison.rows[:k]):
        if (r.phase == "forward" and worst[j] * evidence.CREATES >= given and worst[j] > 0
                and not (r.name.startswith(inside) and inside != ".")):
            return r.name or "(model)", Error(float(worst[j]), evidence.EVIDENCE_METRICS[int(which[j])])
    return None, None


def growth_factors(comparison: StepComparison) -> dict[tuple[str, int, int], float]:
    """(module, call, slot) -> output error / input error on the one scale, for forward rows with a captured
    input whose error is not exactly 0."""
    worst, _ = evidence.errors(comparison)
    inputs: dict[tuple[str, int], float] = {}
    for k, r in enumerate(comparison.rows):
        if r.phase == "input":
            key = (r.name, r.call_index)
            inputs[key] = max(inputs.get(key, 0.0), float(worst[k]))
    factors = {}
    for k, row in enumerate(comparison.rows):
        if row.phase != "forward":
            continue
        given = inputs.get((row.name, row.call_index))
        if given is not None and given > 0:  # growth from an exactly equal input is not a factor
            factors[(row.name, row.call_index, row.slot)] = float(worst[k]) / given
    return factors


def explain(row: Row, comparison: StepComparison, origin: bool = False) -> str:
    """The culprit of a forward first divergence in words ("" for other phases, no input, or no evidence).

    Each sentence states only what the rows show, on the one scale of error: "creates the error" needs an
    output over its tolerance and an input error at most 1/CREATES of the output's; "inherited from the data"
    an input that differs on the first module to run in the step; "inherited from M" a module that ran before
    with an output error of the input's order; "functional operations in the parent's forward" an input that
    differs while every module that ran before it is far below that.  ``origin``: the row is a traced-back
    origin's, whose tolerance is its faithful floor (twinstep.server.detect.origin).
    """
    if row.phase != "forward":
        return ""
    found = classify(row, comparison)
    name = row.name or "(model)"
    out, given = found.output, found.given
    if found.kind == "no input":
        return ""
    # A traced-back origin's row holds its faithful floor where a crossing holds its tolerance.
    limit = "its faithful floor " if origin else ""
    over = f"({row.metric} {row.value:.3g} > {limit}{row.tolerance:.3g})" if row.value > row.tolerance else ""
    if found.kind == "creates":
        if not over:
            return ""
        received = "matches exactly" if given.value == 0 else f"is off by {given}"
        return (f"origin: {name} ({row.type}) creates the error: its input {received} and its output is off by "
                f"{out} {over}, growth {evidence.growth_words(out.value, given.value)}")
    if found.kind == "data":
        return (f"inherited from the data: the input of {name}, the first module to run in step {comparison.step}, "
                f"already differs ({given}): the runs were fed different inputs")
    if found.kind == "inherited":
        return (f"inherited: the input of {name} is already off by {given} (its output by {out}); {found.source}, "
                f"which ran before it, already differs by {found.source_error}: the error comes from there or "
                "earlier")
    return (f"inherited: the input of {name} is already off by {given} (its output by {out}) while every hooked "
            "module that ran before it is far below that: the error arises in code no hooked module covers "
            f"(functional operations in the parent's forward{parent_code(row, comparison)})")


def parent_code(row: Row, comparison: StepComparison) -> str:
    """", in P (T): what its own code does" for the parent of ``row``'s module, when the parent was recorded;
    an attention block's own code is where rotary embeddings, masks and score scaling live."""
    parent = row.name.rsplit(".", 1)[0] if "." in row.name else ""
    if not row.name:
        return ""
    found = next((r for r in comparison.rows if r.phase == "forward" and r.name == parent), None)
    if found is None:
        return ""
    lowered = found.type.lower()
    what = (": its rotary application, attention mask and score scaling" if "attention" in lowered
            or "attn" in lowered else "")
    return f", in {parent or '(model)'} ({found.type}){what}"
