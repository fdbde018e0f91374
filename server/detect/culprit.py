"""Origin or inheritance: does the first divergent module create its error?

Each module's first input is captured too (cheaply: it is usually another
module's output).  A module whose input matches and whose output does not is
the origin.  One whose input already differs inherits the error from code
that no hook sees (functional operations in a parent's forward).  The growth
factor, output error over input error in the same metric, shows how each
module amplifies what it receives.
"""

from __future__ import annotations

from twinstep.server.compare.comparator import Row, StepComparison


def growth_factors(comparison: StepComparison) -> dict[tuple[str, int, int], float]:
    """(module, call, slot) -> output error / input error, for forward rows with a captured input."""
    inputs = {(r.name, r.call_index): k for k, r in enumerate(comparison.rows) if r.phase == "input"}
    factors = {}
    for k, row in enumerate(comparison.rows):
        if row.phase != "forward":
            continue
        k_in = inputs.get((row.name, row.call_index))
        if k_in is None or row.metric not in comparison.values:
            continue
        out_value = float(comparison.values[row.metric][k])
        in_value = float(comparison.values[row.metric][k_in])
        if in_value > 0:  # growth from an exactly equal input is not a factor
            factors[(row.name, row.call_index, row.slot)] = out_value / in_value
    return factors


def explain(row: Row, comparison: StepComparison) -> str:
    """The culprit of a forward first divergence in words ("" for other phases, no input, or no evidence).

    Each sentence states only what the rows show: "creates the error" needs an input within tolerance and an
    output over it; "inherited from the data" an input that differs on the first module to run in the step;
    "functional operations in the parent's forward" an input that differs after a module that ran before it
    and matched (the divergence is the step's first).
    """
    if row.phase != "forward":
        return ""
    k_out = comparison.rows.index(row)
    k_in = next(
        (k for k, r in enumerate(comparison.rows) if r.phase == "input" and r.name == row.name and r.call_index == row.call_index),
        None,
    )
    if k_in is None:
        return ""
    metric = row.metric
    name = row.name or "(model)"
    input_row = comparison.rows[k_in]
    if not input_row.divergent:
        if not row.value > row.tolerance:
            return ""
        values = comparison.values.get(metric)
        out_value = float(values[k_out]) if values is not None else row.value
        in_value = float(values[k_in]) if values is not None else input_row.value
        growth = f"x{out_value / in_value:.3g}" if in_value > 0 else "from exactly 0"
        return (
            f"origin: {name} ({row.type}) creates the error: its input matches ({metric} {in_value:.3g}) and its "
            f"output does not ({metric} {out_value:.3g} > {row.tolerance:.3g}), growth {growth}"
        )
    differs = f"({input_row.metric} {input_row.value:.3g} > {input_row.tolerance:.3g})"
    first_to_run = next((r for r in comparison.rows if r.phase == "forward"), None) is row
    if first_to_run:
        return (
            f"inherited from the data: the input of {name}, the first module to run in step {comparison.step}, "
            f"already differs {differs}: the runs were fed different inputs"
        )
    return (
        f"inherited: the input of {name} already differs {differs}; the error arises before it, in code no "
        "hooked module covers (functional operations in the parent's forward)"
    )
