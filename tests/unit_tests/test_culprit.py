"""Origin or inheritance of a forward divergence."""

from __future__ import annotations

import numpy as np

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.culprit import explain, growth_factors


def comparison(input_error: float, output_error: float, tolerance: float = 1e-5) -> StepComparison:
    def row(phase: str, name: str, value: float) -> Row:
        return Row(phase=phase, name=name, candidate_name=name, type="GELU", call_index=0, slot=0, metric="mean",
                   value=value, tolerance=tolerance, divergent=value > tolerance)

    rows = [row("forward", "fc1", input_error), row("forward", "act", output_error), row("input", "act", input_error)]
    values = {"mean": np.array([input_error, output_error, input_error])}
    return StepComparison(step=0, rank=0, candidate_run="c", rows=rows, values=values)


def test_a_module_with_matching_input_is_the_origin():
    c = comparison(1e-9, 1e-4)
    text = explain(c.first, c)
    assert text.startswith("origin: act (GELU) creates the error") and "growth x1e+05" in text
    assert growth_factors(c)[("act", 0, 0)] == 1e-4 / 1e-9


def test_a_module_whose_input_differs_inherits():
    c = comparison(1e-3, 1.1e-3)
    assert c.first.name == "fc1"  # the producer is flagged first, in production order
    text = explain(c.rows[1], c)
    assert text.startswith("inherited: the input of act already differs")


def test_no_growth_from_an_exactly_equal_input():
    assert growth_factors(comparison(0.0, 1e-4)) == {}


def test_an_input_that_differs_on_the_first_module_to_run_is_the_data():
    c = comparison(1e-3, 1.1e-3)
    text = explain(c.first, c)  # fc1 runs first; its own input is not captured here
    assert text == ""
    rows = [Row(phase="forward", name="embed", candidate_name="embed", type="Embedding", call_index=0, slot=0,
                metric="mean", value=1.0, tolerance=0.0, divergent=True),
            Row(phase="input", name="embed", candidate_name="embed", type="Embedding", call_index=0, slot=0,
                metric="mean", value=3.0, tolerance=0.0, divergent=True)]
    data = StepComparison(step=3, rank=0, candidate_run="c", rows=rows, values={"mean": np.array([1.0, 3.0])})
    text = explain(data.first, data)
    assert text.startswith("inherited from the data: the input of embed, the first module to run in step 3, "
                           "already differs (mean 3 > 0)") and "functional operations" not in text


def test_no_origin_sentence_for_an_output_within_its_tolerance():
    c = comparison(1e-9, 1e-6)  # both within the 1e-5 tolerance: nothing to explain
    assert explain(c.rows[1], c) == ""
