"""The stage a first divergence points at, in words."""

from __future__ import annotations

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.stage import describe


def row(phase: str, name: str, divergent: bool = False, ndim: int = 2, scale: float = 1.0, type: str = "Linear") -> Row:
    return Row(phase=phase, name=name, candidate_name=name, type=type, call_index=0, slot=0, metric="rms",
               value=1.0 if divergent else 0.0, tolerance=0.5, divergent=divergent, ndim=ndim, scale=scale)


def first(rows: list[Row], step: int = 0) -> str:
    comparison = StepComparison(step=step, rank=0, candidate_run="cand", rows=rows)
    return describe(comparison.first, comparison)


def test_forward_at_step_zero_names_the_module():
    text = first([row("forward", "embed"), row("forward", "layers.0.act", True, type="GELU")])
    assert text.startswith("forward: layers.0.act (GELU) is the first module")


def test_first_module_differing_at_a_later_step_is_data():
    text = first([row("forward", "embed", True), row("forward", "layers.0.act", True)], step=3)
    assert text.startswith("data: step 3 differs from its very first module (embed)")


def test_backward_names_the_boundary():
    rows = [row("forward", "fc1"), row("forward", "fc2"), row("backward", "fc2"), row("backward", "fc1", True)]
    assert "between the output gradients of 'fc2' (matches) and 'fc1' (differs)" in first(rows)


def test_common_factor_on_every_gradient_is_clipping():
    rows = [row("grad", "b", True, 1, 0.8), row("grad", "w", True, 2, 0.8001)]
    assert "same factor x0.8" in first(rows) and "clipping" in first(rows)


def test_one_gradient_differing_is_not_clipping():
    rows = [row("grad", "b", True, 1, 0.8), row("grad", "w", False)]
    assert first(rows).startswith("backward: output gradients matched but the gradient of parameter b")


def test_only_one_dimensional_parameters_point_at_weight_decay():
    rows = [row("param", "w"), row("param", "ln.weight", True, 1, 0.9999), row("param", "fc.bias", True, 1, 1.01)]
    text = first(rows)
    assert "only 1-D parameters" in text and "weight decay" in text


def test_every_parameter_with_zero_init_scale_points_at_learning_rate():
    rows = [row("param", "w", True, 2, 1.00001), row("param", "b", True, 1, 1.1), row("param", "c", True, 1, 1.1)]
    assert "learning rate (zero-initialised parameters moved x1.1 as far" in first(rows)
