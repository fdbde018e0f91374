"""Words backed by the numbers beside them: each stage, culprit and long-run sentence printed only when its premise
holds, checked by twinstep.server.report.agreement against the report's own figures (one case where the premise
holds, one where it does not, per kind of sentence)."""

from __future__ import annotations

import numpy as np
import pytest

from twinstep.server.compare.comparator import Row, StepComparison
from twinstep.server.detect.drift import LongRunTracker
from twinstep.server.detect.first_divergence import Candidate
from twinstep.server.ingest.step import StepData
from twinstep.server.report.agreement import check_words, words_agree
from twinstep.server.report.builder import build_report
from twinstep.server.report.render import render_text, report_to_dict
from twinstep.server.report.snapshot import SessionSnapshot
from twinstep.v1 import twinstep_pb2 as pb


def row(phase: str, name: str, divergent: bool = False, ndim: int = 2, scale: float = 1.0, value: float | None = None,
        type: str = "Linear", metric: str = "rms") -> Row:
    value = (1.0 if divergent else 0.0) if value is None else value
    return Row(phase=phase, name=name, candidate_name=name, type=type, call_index=0, slot=0, metric=metric,
               value=value, tolerance=0.5, divergent=divergent, ndim=ndim, scale=scale)


def report(rows: list[Row], step: int = 0, previous: tuple[float, str] | None = None,
           long_run: tuple[pb.LongRun, ...] = ()) -> dict:
    """The JSON form of a one-candidate session whose first divergence is the first divergent row of ``rows``."""
    values = {"rms": np.array([r.value for r in rows])}
    comparison = StepComparison(step=step, rank=0, candidate_run="cand", rows=rows, values=values)
    first = None
    if comparison.first is not None:
        first = Candidate((step, 0, 0, 0), comparison.first, comparison, previous)
    snapshot = SessionSnapshot(
        name="s", status="diverged" if first else "aligned", status_reasons=(), halted=False, runs=(),
        steps_compared=step + 1, first=first, last_comparison=comparison, unmatched_baseline=(),
        unmatched_candidate=(), errors=(), proposed_mapping=None, coverage=(), long_run=long_run, headroom=())
    return report_to_dict(build_report(snapshot))


def kinds(document: dict) -> dict[str, bool]:
    return {c.kind: c.holds for c in check_words(document)}


# ---------------------------------------------------------------- backward: one factor on every output gradient

LOSS_HALVED = [row("forward", "fc1"), row("forward", "fc2"), row("forward", ""), row("loss", ""),
               row("backward", "fc2", True, scale=0.5), row("backward", "fc1", True, scale=0.5),
               row("backward", "", True, scale=0.5)]


def test_a_loss_divided_before_backward_is_named_as_one_factor_on_every_output_gradient():
    document = report(LOSS_HALVED)
    stage = document["stage"]
    assert "every output gradient differs by the same factor x0.5 (3 of 3)" in stage, stage
    assert "loss scaled on one side before backward" in stage
    assert "custom backward" not in stage and "(matches)" not in stage  # no claim the table contradicts
    assert stage.startswith("backward: forward and loss matched;")
    assert kinds(document) == {"one factor (backward)": True}


def test_one_output_gradient_off_is_no_common_factor_and_names_the_boundary():
    rows = [row("forward", "fc1"), row("forward", "fc2"), row("backward", "fc2"),
            row("backward", "fc1", True, scale=0.5)]
    document = report(rows)
    assert "same factor" not in document["stage"]
    assert "between the output gradients of 'fc2' (matches) and 'fc1' (differs)" in document["stage"]
    assert kinds(document) == {"backward boundary": True}


def test_the_first_output_gradient_backward_produces_claims_no_matching_neighbour():
    rows = [row("forward", "fc1"), row("backward", "fc2", True, scale=0.5), row("backward", "fc1", True, scale=0.7),
            row("backward", "", True, scale=0.9)]
    stage = report(rows)["stage"]
    assert "(matches)" not in stage and "the output gradient of 'fc2', the first one backward produces" in stage


def test_the_checker_catches_a_boundary_the_tree_contradicts():
    document = report(LOSS_HALVED)
    document["stage"] = ("backward: forward and loss matched; the first gradient that differs is between the output "
                         "gradients of '(model)' (matches) and 'fc2' (differs)")
    assert kinds(document) == {"backward boundary": False} and not words_agree(document)


# ---------------------------------------------------------------- grad: one factor on every parameter gradient

def test_clipping_is_one_factor_on_every_parameter_gradient_and_no_parameter_growth_advice():
    rows = [row("backward", "fc"), row("grad", "fc.bias", True, 1, 0.8), row("grad", "fc.weight", True, 2, 0.8)]
    document = report(rows, step=4, previous=(0.5, "fc.weight"))
    stage = document["stage"]
    assert "every parameter gradient differs by the same factor x0.8 (2 of 2)" in stage
    assert "Parameters after step" not in stage and "weight decay" not in stage  # a factor is no grown difference
    assert kinds(document) == {"one factor (grad)": True}


def test_the_checker_catches_a_one_factor_claim_over_matching_rows():
    rows = [row("backward", "fc"), row("grad", "fc.bias", True, 1, 0.8), row("grad", "fc.weight", False)]
    document = report(rows)
    assert "same factor" not in document["stage"]
    document["stage"] = "backward: every parameter gradient differs by the same factor x0.8 (2 of 2): clipping"
    assert kinds(document) == {"one factor (grad)": False}


# ---------------------------------------------------------------- parameters after the step before

def test_parameter_growth_advice_needs_a_parameter_difference_to_grow():
    rows = [row("forward", "fc1"), row("forward", "fc2", True)]
    held = report(rows, step=3, previous=(0.42, "fc2.weight"))
    assert "Parameters after step 2 were within tolerance, at up to 0.42 of it (fc2.weight)" in held["stage"]
    assert kinds(held)["parameters before"] is True
    idle = report(rows, step=3, previous=(0.001, "fc2.weight"))  # faithful rounding: "0.00 of it" says nothing
    assert "Parameters after step" not in idle["stage"] and "weight decay" not in idle["stage"]
    idle["stage"] = held["stage"].replace("0.42", "0.00")
    assert kinds(idle)["parameters before"] is False


# ---------------------------------------------------------------- data, and the culprit beside it

def data_rows(input_differs: bool) -> list[Row]:
    return [row("forward", "embed", True, type="Embedding"), row("forward", "fc", True),
            row("input", "embed", input_differs, metric="mean"), row("input", "fc", True)]


def test_a_batch_fed_out_of_order_is_data_in_stage_and_culprit():
    document = report(data_rows(True), step=3, previous=(0.01, "fc.weight"))
    stage, culprit = document["stage"], document["culprit"]
    assert stage.startswith("data: step 3 differs from its very first module (embed), whose input already differs "
                            "(mean 1) while every earlier step, and the weights after step 2, matched"), stage
    assert culprit.startswith("inherited from the data: the input of embed, the first module to run in step 3"), culprit
    assert "functional operations" not in culprit
    assert kinds(document) == {"data": True, "inherited from the data": True}, \
        check_words(document)


def test_a_first_module_whose_input_matches_is_not_data():
    document = report(data_rows(False), step=3)
    stage, culprit = document["stage"], document["culprit"]
    assert not stage.startswith("data") and "embed (Embedding) differs while its input matches" in stage, stage
    assert culprit.startswith("origin: embed (Embedding) creates the error"), culprit
    assert all(kinds(document).values()), check_words(document)


def test_the_checker_catches_a_culprit_that_contradicts_a_data_stage():
    document = report(data_rows(True), step=3)
    document["culprit"] = ("inherited: the input of embed is already off by mean 1 (its output by rms 1) while every "
                           "hooked module that ran before it is far below that: the error arises in code no hooked "
                           "module covers (functional operations in the parent's forward)")
    assert kinds(document)["inherited"] is False


def test_an_inherited_error_after_a_matching_module_blames_the_parents_code():
    rows = [row("forward", "fc1"), row("forward", "act", True, type="GELU"), row("input", "fc1"),
            row("input", "act", True)]
    document = report(rows)
    assert "functional operations in the parent's forward" in document["culprit"]
    assert "its input is already off by rms 1 (its output by rms 1)" in document["stage"]
    assert kinds(document) == {"inherited": True, "input already off": True}, \
        check_words(document)


# ---------------------------------------------------------------- origin (culprit)

def test_origin_culprit_agrees_with_the_trees_growth():
    rows = [row("forward", "fc1", value=1e-3), row("forward", "act", True, value=0.9, type="GELU"),
            row("input", "act", value=1e-3)]
    document = report(rows)
    assert document["culprit"].startswith("origin: act (GELU) creates the error: its input is off by rms 0.001 and "
                                          "its output is off by rms 0.9 (rms 0.9 > 0.5), growth x900")
    assert kinds(document) == {"over tolerance": True, "origin": True, "input matches": True}, check_words(document)
    # An input carrying a tenth or more of the output's error does not match, whatever its own metric says.
    document["culprit"] = document["culprit"].replace("off by rms 0.001", "off by rms 0.2")
    assert kinds(document)["origin"] is False
    document = report(rows)
    document["tree"]["rows"][1]["input_error"] = 0.5  # the tree beside it shows another input error
    assert kinds(document)["origin"] is False


def test_origin_culprit_needs_an_output_over_its_tolerance():
    rows = [row("forward", "act", True, value=0.9), row("input", "act")]
    document = report(rows)
    document["culprit"] = document["culprit"].replace("0.9 > 0.5", "0.4 > 0.5")
    assert kinds(document)["origin"] is False and kinds(document)["over tolerance"] is False


# ---------------------------------------------------------------- optimizer counts

def test_optimizer_counts_agree_with_the_tree():
    rows = [row("grad", "w"), row("param", "w", True, 2), row("param", "b", True, 1), row("param", "c")]
    document = report(rows)
    assert "after the update 2 of 3 parameters differ, first w" in document["stage"], document["stage"]
    assert kinds(document) == {"parameters updated": True}
    document["stage"] = document["stage"].replace("2 of 3", "3 of 3")
    assert kinds(document) == {"parameters updated": False}


# ---------------------------------------------------------------- long run: the loss error's sign

def step_data(step: int, loss: float) -> StepData:
    return StepData(step=step, rank=0, phase=np.array([pb.LOSS]), names=[""], types=["Loss"], call_index=np.zeros(1),
                    slot=np.zeros(1), dtypes=["float32"], shapes=[()], table={"sum": np.array([loss])}, payloads={},
                    nbytes=8)


def long_run(differences: list[float]) -> pb.LongRun:
    tracker = LongRunTracker(window=1000)
    for s, difference in enumerate(differences):
        tracker.add("cand", s, 0, step_data(s, 2.0), step_data(s, 2.0 + difference))
    return tracker.summary("cand", None, 3.0)


@pytest.mark.parametrize("differences", [[1e-7] * 20, [0.0] * 19 + [1e-7], [0.0] * 20])
def test_no_sign_is_claimed_for_rounding_sized_or_zero_loss_errors(differences):
    verdicts = "\n".join(long_run(differences).verdicts)
    assert "biased" not in verdicts and "oscillates" not in verdicts, verdicts


def sign_kinds(document: dict) -> dict[str, bool]:
    """kinds() but the PASS/FAIL criteria, which a summary always has."""
    return {k: v for k, v in kinds(document).items() if k != "long-run criterion"}


def test_a_loss_error_that_matters_is_called_biased_with_its_share_of_the_limit():
    summary = long_run([0.004] * 20)
    verdicts = "\n".join(summary.verdicts)
    assert ("loss error is biased to one side (mean signed / mean absolute = 1.00; mean |Δ| at 0.20 of its "
            "limit)") in verdicts
    document = report([row("forward", "fc")], long_run=(summary,))
    assert sign_kinds(document) == {"loss error sign": True}
    document["long_run"][0]["loss_mean_abs"] = 1e-7  # the same words beside rounding-sized numbers
    document["long_run"][0]["loss_mean_rel"] = 5e-8
    assert sign_kinds(document) == {"loss error sign": False}


def test_a_loss_error_that_alternates_oscillates():
    verdicts = "\n".join(long_run([0.004, -0.004] * 10).verdicts)
    assert "loss error oscillates around 0" in verdicts


# ---------------------------------------------------------------- the text form says the same

def test_text_report_prints_the_words_checked():
    snapshot_text = render_text(_report_proto(LOSS_HALVED))
    assert ("stage: backward: forward and loss matched; every output gradient differs by the same factor "
            "x0.5") in snapshot_text


def _report_proto(rows: list[Row]) -> pb.Report:
    comparison = StepComparison(step=0, rank=0, candidate_run="cand", rows=rows,
                                values={"rms": np.array([r.value for r in rows])})
    first = Candidate((0, 0, 0, 0), comparison.first, comparison)
    snapshot = SessionSnapshot(
        name="s", status="diverged", status_reasons=(), halted=False, runs=(), steps_compared=1, first=first,
        last_comparison=comparison, unmatched_baseline=(), unmatched_candidate=(), errors=(), proposed_mapping=None,
        coverage=(), long_run=(), headroom=())
    report_proto = build_report(snapshot)
    assert words_agree(report_proto)  # a Report message is checked through its JSON form
    return report_proto


@pytest.mark.parametrize("seed", range(40))
def test_words_agree_with_numbers_on_random_steps(seed):
    """Whatever the rows, the sentences printed beside them hold (scales drawn from a few so factors repeat)."""
    rng = np.random.default_rng(seed)
    names = ["embed", "layers.0.fc", "layers.0.act", "layers.1.fc", "head", ""]
    rows = []
    for phase in ("forward", "input", "loss", "backward", "grad", "param"):
        if rng.random() < 0.2:
            continue  # a phase not captured
        for name in (names if phase != "loss" else [""]):
            if phase == "input" and (not name or rng.random() < 0.3):
                continue
            divergent = bool(rng.random() < 0.3)
            value = float(rng.choice([0.0, 1e-3, 0.2])) if not divergent else float(rng.choice([0.9, 2.0]))
            scale = float(rng.choice([1.0, 0.5])) if divergent else 1.0
            rows.append(row(phase, name if phase not in ("grad", "param") else f"{name or 'root'}.weight", divergent,
                            int(rng.choice([1, 2])), scale, value))
    previous = (float(rng.choice([0.0, 0.004, 0.3])), "w") if rng.random() < 0.7 else None
    document = report(rows, step=int(rng.integers(0, 3)), previous=previous)
    assert words_agree(document), [c for c in check_words(document) if not c.holds]


# ---------------------------------------------------------------- forward: the module the error arises in

INHERITED_CHAIN = [row("forward", "fc1", value=0.3), row("forward", "fc2", value=0.3),
                   row("forward", "act", True, value=0.9, type="GELU"), row("input", "act", value=0.3)]


def test_the_stage_names_the_earlier_module_the_culprit_names():
    document = report(INHERITED_CHAIN)
    assert document["stage"].endswith("the error arises before it, in fc1 or before it (its output already differs "
                                      "by rms 0.3)"), document["stage"]
    assert "fc1, which ran before it, already differs by rms 0.3" in document["culprit"], document["culprit"]
    assert kinds(document)["earlier source"] is True and words_agree(document)


def test_the_checker_catches_a_stage_source_too_small_or_other_than_the_culprits():
    document = report(INHERITED_CHAIN)
    stage = document["stage"]
    document["stage"] = stage.replace("(its output already differs by rms 0.3)",
                                      "(its output already differs by rms 0.01)")  # 1/30 of the input's error
    assert kinds(document)["earlier source"] is False
    document["stage"] = stage.replace("in fc1 or before it", "in fc2 or before it")  # the culprit says fc1
    assert kinds(document)["earlier source"] is False and not words_agree(document)


# ---------------------------------------------------------------- long run: each criterion's PASS or FAIL

def criteria(document: dict) -> list[bool]:
    return [c.holds for c in check_words(document) if c.kind == "long-run criterion"]


def test_long_run_criteria_print_the_summarys_figures_and_pass_within_their_limits():
    document = report([row("forward", "fc")], long_run=(long_run([0.004] * 20),))
    verdicts = document["long_run"][0]["verdicts"]
    assert "PASS first loss: |Δ| 0.004, 0.2% (limit 0.005 or 0.5%)" in verdicts, verdicts
    assert "PASS mean loss error: |Δ| 0.004, 0.2% over 20 steps (limit 0.01 or 1%)" in verdicts
    assert criteria(document) == [True, True]
    failing = report([row("forward", "fc")], long_run=(long_run([0.3] * 20),))
    assert failing["long_run"][0]["verdicts"][0].startswith("FAIL first loss: |Δ| 0.3, 15%")
    assert criteria(failing) == [True, True]


def test_the_checker_catches_a_pass_over_its_limit_and_figures_not_the_summarys():
    document = report([row("forward", "fc")], long_run=(long_run([0.004] * 20),))
    summary = document["long_run"][0]
    summary["first_loss_abs"], summary["first_loss_rel"] = 0.3, 0.15  # PASS printed beside a first loss over both
    assert criteria(document) == [False, True]
    document = report([row("forward", "fc")], long_run=(long_run([0.004] * 20),))
    summary = document["long_run"][0]
    summary["verdicts"][1] = summary["verdicts"][1].replace("over 20 steps", "over 50 steps")
    assert criteria(document) == [True, False]


def test_the_noise_criterion_compares_the_mean_loss_error_with_the_reference_runs():
    tracker = LongRunTracker(window=1000)
    for s in range(20):
        tracker.add("cand", s, 0, step_data(s, 2.0), step_data(s, 2.0 + 0.004))
        tracker.add("rerun", s, 0, step_data(s, 2.0), step_data(s, 2.0 + 0.001))
    document = report([row("forward", "fc")], long_run=(tracker.summary("cand", "rerun", 3.0),))
    noise = [v for v in document["long_run"][0]["verdicts"] if "own noise" in v]
    assert noise == ["FAIL within the baseline's own noise: mean loss |Δ| 0.004 vs 3 x reference 0.001"], noise
    assert criteria(document) == [True, True, True]
    document["long_run"][0]["reference_loss_mean_abs"] = 0.002  # 3 x 0.002 holds 0.004: FAIL is wrong beside it
    assert criteria(document)[-1] is False
