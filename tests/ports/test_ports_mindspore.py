"""Real port to MindSpore: transformers' Phi3 (torch) vs its MindSpore port (tests/ports/mindspore_phi3.py).

Each framework runs in its own process, random weights written by the torch job and
converted by the MindSpore job, identical data, AdamW, float32, real gRPC to one
server shared by the file's tests. The corpus of porting bugs is found at the step,
phase and module measured outside twinstep (models.EXPECTED_ORIGIN_MINDSPORE,
tests/ports/mindspore_origins.py). Needs transformers and mindspore.
"""

from __future__ import annotations

import pytest

from tests.mindspore_env import skip_module_without_mindspore

skip_module_without_mindspore()
pytest.importorskip("transformers")

from tests.ports import models  # noqa: E402
from tests.ports.sessions import Candidate, run_session  # noqa: E402
from twinstep.server import serve  # noqa: E402

JOB = "tests.ports.mindspore_job"

#: Bugs found by default tolerances at their origin within two steps.
AT_ORIGIN = ("norm_eps", "act_variant", "untransposed", "lr", "custom_backward")
FAITHFUL_STEPS = 50
BUG_STEPS = 6  # batch_order swaps the batches of steps 3 and 4; decay's linear growth shows by step 4


@pytest.fixture(scope="module")
def server():
    handle = serve(port=0)
    yield handle
    handle.stop(grace=0.5)


@pytest.fixture(scope="module")
def corpus(server):
    """One torch baseline, the faithful MindSpore port and every buggy one, in one session: each candidate
    is compared against the baseline on its own (its own section of the report, Report.candidates)."""
    candidates = [Candidate("faithful", JOB, FAITHFUL_STEPS)]
    candidates += [Candidate(bug, JOB, BUG_STEPS, bug) for bug in (*AT_ORIGIN, "batch_order", "wd_on_norms")]
    run_session(server.address, "ms-corpus", "phi3", FAITHFUL_STEPS, candidates)
    report = server.report_proto("ms-corpus")
    return report, {c.candidate_run: c for c in report.candidates}


def test_faithful_mindspore_port_stays_aligned_for_50_steps(server, corpus):
    report, sections = corpus
    faithful = sections["faithful"]
    assert faithful.status == "aligned", f"{faithful.first_divergence} {faithful.stage}"
    assert faithful.steps_compared == FAITHFUL_STEPS
    # Every torch record has its MindSpore counterpart (nn.Embedding's table included): no candidate
    # leaves a baseline record unmatched (the buggy custom_backward one aside, whose Cell has a bprop:
    # MindSpore runs no forward hook there, docs/mindspore.md).
    assert [n for n in report.unmatched_baseline if "activation_fn" not in n] == [], list(report.unmatched_baseline)
    verdicts = next(r for r in report.long_run if r.candidate_run == "faithful").verdicts
    assert "FAIL" not in "\n".join(verdicts)


@pytest.mark.parametrize("bug", AT_ORIGIN)
def test_mindspore_porting_bug_found_at_its_origin(corpus, bug):
    _, sections = corpus
    found = sections[bug]
    first = found.first_divergence
    step, phase, module, _ = models.EXPECTED_ORIGIN_MINDSPORE[bug]
    assert found.status == "diverged", found.stage
    assert (first.step, first.phase) == (step, phase), first
    if phase == "param":
        # A learning-rate bug moves every parameter: no module is its origin; the stage names the cause.
        assert "learning rate" in found.stage, found.stage
    else:
        assert first.module == module, first
    if bug == "custom_backward":
        assert found.stage.startswith("backward:") and "custom backward" in found.stage, found.stage


def test_mindspore_batch_fed_out_of_order_is_a_data_divergence(corpus):
    _, sections = corpus
    found = sections["batch_order"]
    first = found.first_divergence
    assert (first.step, first.phase, first.module) == models.EXPECTED_ORIGIN_MINDSPORE["batch_order"][:3]
    assert found.stage.startswith("data: step 3 differs from its very first module"), found.stage


def test_mindspore_weight_decay_on_norms_is_traced_back_to_its_origin(corpus):
    """1e-5 relative on norm weights per step: inside flat tolerances, traced back to the first update with no
    reference run (server/detect/origin.py, calibrated on the paddle ports)."""
    _, sections = corpus
    found = sections["wd_on_norms"]
    first = found.first_divergence
    assert (first.step, first.phase, first.module) == models.EXPECTED_ORIGIN_MINDSPORE["wd_on_norms"][:3], first
    assert first.HasField("origin"), first
    assert "only 1-D parameters" in found.stage and "weight decay" in found.stage, found.stage
