"""Say in words which stage of training a first divergence points at.

Follows the order porting guides align a training in: step-0 forward differs -> forward; forward matches,
output or parameter gradients differ -> backward; forward and gradients match,
parameters after the update differ -> optimizer; weights matched after step
k-1 but step k's very first module differs -> data.  A named record
(Monitor.record) that diverges first is said in the words of what its name
says it is: the data, the learning rate schedule, the gradient norm.
"""

from __future__ import annotations

import re

from typing import TYPE_CHECKING

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.culprit import classify, parent_code
from twinstep.server.detect.origin import module_kind
from twinstep.wire.phases import STEP_ORDER, step_position

if TYPE_CHECKING:
    from twinstep.server.detect.origin import Origin

_COMMON_FACTOR = 1e-3  # relative spread under which per-tensor scales count as one factor


#: Closest approach of the parameters to their tolerance, after the step before, from which a difference
#: too small to flag is worth naming as what may have grown into the divergence.  Faithful float32 ports stay
#: near 1e-3 of the default tolerances; 0.01 is ten times that, and never prints as "0.00 of it".
PARAM_GROWTH_PREMISE = 0.01


def describe(row: Row, comparison: StepComparison, previous_params: tuple[float, str] | None = None) -> str:
    """The stage in words; every clause says only what the rows of ``comparison`` (and the parameters' closest
    approach to tolerance after the step before, ``previous_params``: ratio, name) show."""
    text = _describe(row, comparison, previous_params)
    if (comparison.step > 0 and row.phase in ("forward", "backward", "grad") and previous_params is not None
            and not text.startswith("data") and " by the same factor " not in text
            and PARAM_GROWTH_PREMISE <= previous_params[0] <= 1.0):
        ratio, param = previous_params
        text += (
            f". Parameters after step {comparison.step - 1} were within tolerance, at up to {ratio:.2f} of it "
            f"({param}): a parameter difference too small to flag can grow into this (weight decay or epsilon "
            "applied differently); a reference run tightens tolerances to the baseline's own noise"
        )
    return text


#: Words in a record's name -> what the value is, and what to check when it differs.
_DATA_WORDS = frozenset({"input", "inputs", "ids", "labels", "label", "tokens", "token", "mask", "batch", "data",
                         "targets", "target", "pixel", "pixels", "images", "image", "position", "sample", "samples"})
_RECORD_KINDS = (
    (lambda words, name: "lr" in words or "learning" in words or name.startswith("lr"),
     "learning rate schedule",
     "the learning rates differ from this step on: check the warmup length, the decay, the step the scheduler "
     "counts from, and where scheduler.step() is called"),
    (lambda words, name: bool(words & _DATA_WORDS),
     "data pipeline",
     "the runs were fed other inputs: check batch order, shuffling and sampler seeds, tokenization and padding; "
     "sync batches (Monitor.baseline_batch) to align the model first, then align the pipeline"),
    (lambda words, name: ("grad" in words and "norm" in words) or "gradnorm" in name,
     "gradient norm",
     "check gradient clipping and how the norm is taken (which parameters, which norm, before or after scaling)"),
    (lambda words, name: "loss" in words,
     "loss value",
     "check the loss function, its reduction and label handling"),
)


def record_kind(name: str) -> tuple[str, str] | None:
    """(what a named value is, what to check) from the words of its name; None when the name says neither."""
    lowered = name.lower()
    words = set(re.split(r"[^a-z0-9]+", lowered)) - {""}
    for test, kind, hint in _RECORD_KINDS:
        if test(words, lowered):
            return kind, hint
    return None


def _describe_record(row: Row, comparison: StepComparison) -> str:
    step = comparison.step
    before = f"every record before it in step {step}" + (" and every earlier step" if step else "")
    found = record_kind(row.name)
    if found is None:
        return (f"named value {row.name!r} (Monitor.record) differs at step {step} ({row.metric} {row.value:.3g} > "
                f"{row.tolerance:.3g}) while {before} matched: compare how the two runs compute it")
    kind, hint = found
    return (f"{kind}: the named value {row.name!r} differs at step {step} while {before} matched; {hint}")


def _describe(row: Row, comparison: StepComparison, previous_params: tuple[float, str] | None = None) -> str:
    name = row.name or "(model)"
    step = comparison.step
    if row.phase == "record":
        return _describe_record(row, comparison)
    in_phase = [r for r in comparison.rows if r.phase == row.phase]
    divergent = [r for r in in_phase if r.divergent]
    if row.phase == "forward":
        return _describe_forward(row, comparison, in_phase, previous_params)
    if row.phase == "loss":
        # One scalar always has a ratio: it is given as a figure, not as evidence of a scaled loss.
        ratio = f" (candidate x{row.scale:.4g} of the baseline's)" if abs(row.scale - 1.0) > _COMMON_FACTOR else ""
        return (f"loss: {_lead(_matched(comparison, 'loss'))}the loss differs{ratio}; check the loss function, its "
                "reduction (sum or mean, a divisor such as accumulation steps) and label handling")
    if row.phase == "backward":
        before = _matched(comparison, "backward")
        same = _one_factor("output", divergent, in_phase)
        if same:
            return (f"backward: {_lead(before)}{same}: the loss scaled on one side before backward (a loss divided "
                    "by accumulation steps or a world size, loss scaling not undone)")
        position = in_phase.index(row)
        if position == 0:
            where = (f"the output gradient of {name!r}, the first one backward produces: check what lies between "
                     "it and the loss (the loss's backward and scaling, functional code after it)")
        else:
            where = (f"between the output gradients of {in_phase[position - 1].name or '(model)'!r} (matches) and "
                     f"{name!r} (differs): check the backward of the code in between (a custom backward, detach, "
                     "in-place ops)")
        return f"backward: {_lead(before)}the first gradient that differs is {where}"
    if row.phase == "grad":
        before = _matched(comparison, "grad")
        same = _one_factor("parameter", divergent, in_phase)
        if same:
            return f"backward: {_lead(before)}{same}: gradient clipping or loss scaling on one side"
        return (
            f"backward: {_lead(before)}the gradient of parameter {name} differs: check "
            "how that parameter is used (weight tying, gradient hooks, a custom backward)"
        )
    if row.phase == "param":
        return _describe_param(row, comparison, in_phase, divergent)
    return row.phase


def _describe_forward(row: Row, comparison: StepComparison, in_phase: list[Row],
                      previous_params: tuple[float, str] | None) -> str:
    """Data, inherited or the module's own: by where the module ran in the step and its captured input, read
    on the one scale of error (twinstep.server.detect.culprit.classify, which the culprit line states too)."""
    name, step = row.name or "(model)", comparison.step
    found = classify(row, comparison)
    if found.kind == "data" or (found.first_to_run and step > 0 and found.given is None):
        words = f", whose input already differs ({found.given})" if found.kind == "data" else ""
        weights = (f", and the weights after step {step - 1}," if previous_params is not None
                   and previous_params[0] <= 1.0 else "")
        earlier = f" while every earlier step{weights} matched" if step else ""
        return (
            f"data: step {step} differs from its very first module ({name}){words}{earlier}: the candidate was "
            "fed different inputs (batch order, shuffling, preprocessing)"
        )
    at = f" at step {step}" if step else ""
    if found.kind in ("inherited", "unhooked"):
        where = (f"in {found.source} or before it (its output already differs by {found.source_error})"
                 if found.kind == "inherited" else f"in code between the hooked modules{parent_code(row, comparison)}")
        return (
            f"forward{at}: {name} ({row.type}) is the first module over its tolerance, and its input is already "
            f"off by {found.given} (its output by {found.output}): the error arises before it, {where}"
        )
    evidence = f" while its input matches ({found.given})" if found.given is not None else ""
    if step > 0:
        return (
            f"forward at step {step}: every earlier record was within tolerance, yet {name} ({row.type}) "
            f"differs{evidence}: a data-dependent difference in that module, or an earlier difference that grew"
        )
    inputs = (f"its input matches ({found.given})" if found.given is not None else
              "the first module to run; its input is not compared" if found.first_to_run else
              "every module that ran before it matches")
    return (
        f"forward: {name} ({row.type}) is the first module whose output differs ({inputs}); check "
        f"{_FORWARD_HINTS[module_kind(row.type)]}"
    )


def _describe_param(row: Row, comparison: StepComparison, in_phase: list[Row], divergent: list[Row]) -> str:
    name, step = row.name or "(model)", comparison.step
    matrices = [r for r in divergent if r.ndim >= 2]
    if not matrices:
        kind = "only 1-D parameters (norm weights, biases)"
        hint = ("weight decay applied to parameters the baseline exempts (or the reverse), or the "
                "optimizer's epsilon or betas if their gradients are tiny")
    elif len(divergent) >= 0.9 * len(in_phase):
        kind = f"{len(divergent)} of {len(in_phase)} parameters"
        hint = ("the learning rate and its schedule (warmup length, the step the scheduler counts from), betas "
                "or epsilon")
        zero_init = _common_factor([r for r in divergent if r.ndim == 1 and abs(r.scale - 1.0) > _COMMON_FACTOR])
        if step == 0 and zero_init is not None:
            hint = f"learning rate (zero-initialised parameters moved x{zero_init:.4g} as far in the first update)"
    else:
        kind = f"{len(divergent)} of {len(in_phase)} parameters"
        hint = ("per-parameter-group settings (learning rate, weight decay, clipping of some groups), the "
                "optimizer's epsilon or betas, which move first the parameters whose gradients are tiny, or the "
                "learning rate and its schedule")
    before = _matched(comparison, "param")
    return f"optimizer: {_lead(before)}after the update {kind} differ, first {name}: check {hint}"


def describe_origin(origin: "Origin") -> str:
    """The stage of a divergence traced back to its origin (twinstep.server.detect.origin), naming the cause."""
    row, step = origin.row, origin.comparison.step
    if row.phase == "forward":
        kind = origin.created[2] if origin.created is not None else "block"
        return (f"forward: {row.name} ({row.type}) creates an error at step {step}, under every flat tolerance: "
                f"{origin.evidence}. Check {_FORWARD_HINTS.get(kind, _FORWARD_HINTS['block'])}")
    n = origin.involved_total
    if origin.one_dimensional:
        kind = f"only 1-D parameters (norm weights, biases; {n} of them)"
        hint = ("weight decay applied to parameters the baseline exempts (or the reverse), or the optimizer's "
                "epsilon or betas if their gradients are tiny (zero-initialised norm weights move first)")
        if origin.shrink is not None:
            hint = (f"weight decay: each shrinks by the same factor x{origin.shrink:.7g} per step, as decay does "
                    f"(1 - lr x weight decay = {origin.shrink:.7g}); check which parameters the candidate decays")
    else:
        in_phase = len(origin.comparison.rows)
        kind = f"{n} of {in_phase} parameters"
        hint = ("the optimizer's epsilon (it moves first the parameters whose gradients are tiny), betas, the "
                "learning rate and its schedule, or per-parameter-group settings (learning rate, weight decay, "
                "clipping of some groups)")
    return (f"optimizer: traced back to the update of step {step}: {kind} moved away from the baseline, first "
            f"{row.name}, under every flat tolerance ({origin.evidence}): check {hint}")


#: What to check in a module that creates a forward error, by its kind (twinstep.server.detect.origin.module_kind).
_FORWARD_HINTS = {
    "norm": "its epsilon, whether it centres (LayerNorm) or not (RMSNorm), its weight offset (1 + w) and the dtype "
            "of its variance",
    "rotary": "the rotary base, the position ids, and rotate-half against interleaved pairs",
    "embedding": "the table and any scaling of its output (x sqrt(hidden size))",
    "linear": "its weight layout ([in, out] against [out, in]) and the precision of its product",
    "activation": "the activation variant (exact against tanh GELU, SiLU against GELU)",
    "block": "its own operations between its children: scaling, masks, residuals, dtype casts",
}

_PHASE_WORDS = {"forward": "forward", "loss": "loss", "backward": "output gradients", "grad": "parameter gradients"}


def _matched(comparison: StepComparison, phase: str) -> str:
    """"forward and loss matched": the phases before ``phase`` this step compared (all within tolerance, since
    the divergence comes after them); "" when it compared none of them."""
    earlier = STEP_ORDER[:step_position(phase)]
    present = [_PHASE_WORDS[p] for p in earlier if any(r.phase == p for r in comparison.rows)]
    if not present:
        return ""
    words = present[0] if len(present) == 1 else ", ".join(present[:-1]) + " and " + present[-1]
    return f"{words} matched"


def _lead(matched: str) -> str:
    return f"{matched}; " if matched else ""


def _input_row(row: Row, comparison: StepComparison) -> Row | None:
    """The captured input of a forward row's module call, if any."""
    return next((r for r in comparison.rows if r.phase == "input" and r.name == row.name
                 and r.call_index == row.call_index), None)


def _one_factor(kind: str, divergent: list[Row], in_phase: list[Row]) -> str:
    """"every <kind> gradient differs by the same factor xF (n of n)" when every record of the phase (two or
    more) differs by one common factor; "" otherwise."""
    factor = _common_factor(divergent)
    if factor is None or len(divergent) != len(in_phase) or len(in_phase) < 2:
        return ""
    return f"every {kind} gradient differs by the same factor x{factor:.4g} ({len(in_phase)} of {len(in_phase)})"


def _common_factor(rows: list[Row]) -> float | None:
    scales = [r.scale for r in rows]
    if not scales:
        return None
    low, high = min(scales), max(scales)
    if low <= 0 or high / low - 1.0 > _COMMON_FACTOR or abs(low - 1.0) <= _COMMON_FACTOR:
        return None
    return (low + high) / 2
