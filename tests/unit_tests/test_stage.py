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
    # No output gradient was compared: the stage does not say they matched.
    assert first(rows).startswith("backward: the gradient of parameter b differs")
    rows = [row("backward", "fc"), *rows]
    assert first(rows).startswith("backward: output gradients matched; the gradient of parameter b differs")


def test_only_one_dimensional_parameters_point_at_weight_decay():
    rows = [row("param", "w"), row("param", "ln.weight", True, 1, 0.9999), row("param", "fc.bias", True, 1, 1.01)]
    text = first(rows)
    assert "only 1-D parameters" in text and "weight decay" in text


def test_every_parameter_with_zero_init_scale_points_at_learning_rate():
    rows = [row("param", "w", True, 2, 1.00001), row("param", "b", True, 1, 1.1), row("param", "c", True, 1, 1.1)]
    assert "learning rate (zero-initialised parameters moved x1.1 as far" in first(rows)


# Each sentence says only what the rows show: one case where its premise holds, one where it does not.

def test_loss_gives_its_ratio_only_when_it_has_one():
    forward = [row("forward", "fc")]
    assert "the loss differs (candidate x0.5 of the baseline's)" in first([*forward, row("loss", "", True, 0, 0.5)])
    text = first([*forward, row("loss", "", True, 0, 1.0)])
    assert text.startswith("loss: forward matched; the loss differs; check") and " x" not in text
    assert first([row("loss", "", True, 0, 1.0)]).startswith("loss: the loss differs")  # no forward compared


def test_one_factor_on_output_gradients_needs_every_one_to_share_it():
    held = first([row("loss", ""), row("backward", "fc2", True, scale=0.5), row("backward", "fc1", True, scale=0.5)])
    assert held.startswith("backward: loss matched; every output gradient differs by the same factor x0.5 (2 of 2)")
    mixed = first([row("backward", "fc2", True, scale=0.5), row("backward", "fc1", True, scale=0.9)])
    assert "same factor" not in mixed and "(matches)" not in mixed
    assert "the output gradient of 'fc2', the first one backward produces" in mixed


def test_a_module_whose_input_already_differs_is_not_told_to_check_its_implementation():
    own = first([row("forward", "fc"), row("forward", "act", True, type="GELU"), row("input", "act")])
    assert "(its input matches (rms 0)); check the activation variant" in own
    inherited = first([row("forward", "fc"), row("forward", "act", True, type="GELU"), row("input", "act", True)])
    assert "check the activation variant" not in inherited
    assert ("act (GELU) is the first module over its tolerance, and its input is already off by rms 1 (its "
            "output by rms 1): the error arises before it") in inherited


def test_data_at_step_zero_needs_an_input_that_differs():
    rows = [row("forward", "embed", True, type="Embedding"), row("input", "embed", True)]
    assert first(rows).startswith("data: step 0 differs from its very first module (embed), whose input already "
                                  "differs (rms 1): the candidate was fed different inputs")
    rows = [row("forward", "embed", True, type="Embedding"), row("input", "embed")]
    assert first(rows).startswith("forward: embed (Embedding) is the first module whose output differs (its input "
                                  "matches (rms 0))")


def test_data_claims_matching_weights_only_when_they_were_compared():
    rows = [row("forward", "embed", True), row("forward", "fc", True)]
    comparison = StepComparison(step=3, rank=0, candidate_run="cand", rows=rows)
    assert "and the weights after step 2, matched" in describe(comparison.first, comparison, (0.2, "fc.weight"))
    assert "weights" not in describe(comparison.first, comparison, None)


def test_what_to_check_follows_the_kind_of_module():
    assert "check its epsilon" in first([row("forward", "ln", True, type="LayerNorm"), row("input", "ln")])
    assert "its weight layout" in first([row("forward", "fc", True, type="Linear"), row("input", "fc")])
    assert "the rotary base" in first([row("forward", "rope", True, type="RotaryEmbedding"), row("input", "rope")])


def test_code_between_hooks_in_an_attention_block_names_what_its_own_code_does():
    rows = [row("forward", "attn.q"), row("forward", "attn.o", True), row("forward", "attn", True, type="Attention"),
            row("input", "attn.q"), row("input", "attn.o", True)]
    text = first(rows)
    assert "in code between the hooked modules, in attn (Attention): its rotary application, attention mask" in text
    plain = [row("forward", "mlp.fc1"), row("forward", "mlp.fc2", True), row("forward", "mlp", True, type="MLP"),
             row("input", "mlp.fc1"), row("input", "mlp.fc2", True)]
    assert "rotary" not in first(plain) and "in mlp (MLP)" in first(plain)


def test_a_later_step_says_its_input_matches_only_when_it_was_compared():
    rows = [row("forward", "embed"), row("forward", "fc", True)]
    assert "yet fc (Linear) differs: a data-dependent" in first(rows, step=2)
    assert "yet fc (Linear) differs while its input matches (rms 0)" in first([*rows, row("input", "fc")], step=2)


def test_optimizer_says_which_earlier_phases_matched():
    rows = [row("forward", "fc"), row("grad", "w"), row("param", "w", True, 2), row("param", "b", True, 1)]
    assert first(rows).startswith("optimizer: forward and parameter gradients matched; after the update 2 of 2")
    assert first(rows[2:]).startswith("optimizer: after the update 2 of 2 parameters differ")
