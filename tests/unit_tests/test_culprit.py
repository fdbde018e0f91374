"""Origin or inheritance of a forward divergence, judged on one scale of error (server/detect/evidence.py)."""

from __future__ import annotations

import numpy as np

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.culprit import classify, explain, growth_factors
from twinstep.server.detect.evidence import CREATES, errors


def _row(phase: str, name: str, value: float, tolerance: float = 1e-5, type_: str = "GELU",
         metric: str = "mean") -> Row:
    return Row(phase=phase, name=name, candidate_name=name, type=type_, call_index=0, slot=0, metric=metric,
               value=value, tolerance=tolerance, divergent=value > tolerance)


def _comparison(records: list[tuple[str, str, dict[str, float]]], step: int = 0,
                tolerance: float = 1e-5) -> StepComparison:
    """Rows (phase, name, {metric: value}); each row's verdict metric is "mean", as a tolerance crossing names."""
    rows, values = [], {m: [] for m in ("rms", "mean", "extrema")}
    for phase, name, metrics in records:
        rows.append(_row(phase, name, metrics.get("mean", 0.0), tolerance))
        for m in values:
            values[m].append(metrics.get(m, 0.0))
    return StepComparison(step=step, rank=0, candidate_run="c", rows=rows,
                          values={m: np.array(v) for m, v in values.items()})


def test_the_error_is_the_worst_statistic_over_the_tensors_own_scale():
    c = _comparison([("forward", "norm", {"mean": 1e-9, "rms": 1.6e-5, "extrema": 2e-6})])
    worst, which = errors(c)
    assert worst[0] == 1.6e-5 and which[0] == 0  # rms, not the mean that a normalized tensor leaves at ~0


def test_a_module_that_creates_its_error_is_the_origin():
    c = _comparison([("forward", "fc1", {"rms": 1e-8}), ("forward", "act", {"mean": 1e-4, "rms": 2e-4}),
                     ("input", "act", {"rms": 1e-8})])
    text = explain(c.rows[1], c)
    assert text.startswith("origin: act (GELU) creates the error: its input is off by rms 1e-08 and its output is "
                           "off by rms 0.0002 (mean 0.0001 > 1e-05), growth x2e+04"), text
    assert growth_factors(c)[("act", 0, 0)] == 2e-4 / 1e-8


def test_an_input_under_tolerance_that_carries_the_error_is_no_match():
    """The premise of "creates": the input's error is at most 1/CREATES of the output's on the same scale.
    An input whose mean matches but whose extrema carry 2e-5 does not match an output off by 4e-5."""
    c = _comparison([("forward", "norm", {"extrema": 2.2e-5}), ("forward", "proj", {"mean": 2e-5, "extrema": 4e-5}),
                     ("input", "proj", {"mean": 1e-9, "extrema": 2.17e-5})])
    found = classify(c.rows[1], c)
    assert found.kind == "inherited" and found.source == "norm", found
    text = explain(c.rows[1], c)
    assert "creates" not in text and text.startswith("inherited: the input of proj is already off by extrema "
                                                     "2.17e-05 (its output by extrema 4e-05); norm, which ran "
                                                     "before it, already differs by extrema 2.2e-05"), text


def test_an_input_carrying_the_error_with_no_hooked_source_is_code_between_hooks():
    c = _comparison([("forward", "fc1", {"rms": 1e-9}), ("forward", "act", {"mean": 1.1e-3}),
                     ("input", "act", {"mean": 1e-3})])
    assert classify(c.rows[1], c).kind == "unhooked"
    assert "functional operations in the parent's forward" in explain(c.rows[1], c)


def test_a_child_that_ran_inside_the_module_is_not_its_source():
    """A block's children end before it, but its input was taken before they ran."""
    c = _comparison([("forward", "layer.fc", {"mean": 5e-3}), ("forward", "layer", {"mean": 1.1e-3}),
                     ("input", "layer", {"mean": 1e-3})])
    assert classify(c.rows[1], c).kind == "unhooked"


def test_no_growth_from_an_exactly_equal_input():
    c = _comparison([("forward", "act", {"mean": 1e-4}), ("input", "act", {})])
    assert growth_factors(c) == {}
    assert "its input matches exactly" in explain(c.rows[0], c) and "growth from exactly 0" in explain(c.rows[0], c)


def test_an_input_that_differs_on_the_first_module_to_run_is_the_data():
    rows = [_row("forward", "embed", 1.0, 0.0, "Embedding"), _row("input", "embed", 3.0, 0.0, "Embedding")]
    data = StepComparison(step=3, rank=0, candidate_run="c", rows=rows,
                          values={"mean": np.array([1.0, 3.0]), "rms": np.zeros(2), "extrema": np.zeros(2)})
    text = explain(data.first, data)
    assert text.startswith("inherited from the data: the input of embed, the first module to run in step 3, "
                           "already differs (mean 3)") and "functional operations" not in text


def test_the_first_module_whose_input_is_within_tolerance_is_not_the_data():
    """The data premise needs the input over its own tolerance, not only an error of the output's order."""
    rows = [_row("forward", "embed", 2e-5, 1e-5, "Linear"), _row("input", "embed", 1e-5, 1e-5, "Linear")]
    c = StepComparison(step=3, rank=0, candidate_run="c", rows=rows,
                       values={"mean": np.array([2e-5, 1e-5]), "rms": np.zeros(2), "extrema": np.zeros(2)})
    assert classify(c.rows[0], c).kind == "unhooked"
    assert not explain(c.rows[0], c).startswith("inherited from the data")


def test_no_origin_sentence_for_an_output_within_its_tolerance():
    c = _comparison([("forward", "act", {"mean": 1e-6}), ("input", "act", {"mean": 1e-9})])
    assert explain(c.rows[0], c) == ""


def test_creating_needs_the_stated_factor():
    just = _comparison([("forward", "act", {"mean": 1e-3}), ("input", "act", {"mean": 1e-3 / CREATES})])
    assert classify(just.rows[0], just).kind == "creates"
    short = _comparison([("forward", "fc", {"mean": 1e-9}), ("forward", "act", {"mean": 1e-3}),
                         ("input", "act", {"mean": 1.01e-3 / CREATES})])
    assert classify(short.rows[1], short).kind == "unhooked"
