"""Real ports: Hugging Face transformers (torch) vs paddleformers (paddle), real model code.

Each framework runs in its own process (tests/ports), random weights converted
from torch, identical data, AdamW, float32.  Needs transformers and paddleformers
(the `latest` and `paddleformers` test legs install them; tests/envs).
"""

from __future__ import annotations

import pytest

from tests.ports import models
from tests.ports.corpus import DETECTABLE, FUSED_MAPPING, GUIDE, NEED_REFERENCE, run_pair
from tests.ports.sessions import Candidate, run_session
from twinstep.server.report.agreement import check_words
from twinstep.server import serve
from twinstep.server.config import config_from_dict
from twinstep.server.report.render import render_text


#: Bugs of the corpus that touch every parameter, and the words the stage must name them by.
GLOBAL_CAUSE = {"lr": "learning rate", "grad_clip": "clipping"}
CORPUS_BUGS = (*DETECTABLE, "batch_order", "custom_backward", *NEED_REFERENCE)


#: Steps each buggy candidate trains: enough for its origin to show (batch_order swaps steps 3 and 4; gemma3's
#: decayed norms show linear growth by step 4).
BUG_STEPS = {**dict.fromkeys(CORPUS_BUGS, 2), "batch_order": 5, "wd_on_norms": 6}


@pytest.fixture(scope="module")
def ports_server():
    handle = serve(port=0, config=config_from_dict({"mapping": FUSED_MAPPING}))
    yield handle
    handle.stop(grace=0.5)


class _Corpus:
    """Per model, one session: the torch baseline and one paddle candidate per bug of the corpus, each compared
    against the baseline on its own (Report.candidates), trained once and shared by the tests of that model."""

    def __init__(self, server) -> None:
        self.server = server
        self._sections: dict[str, dict] = {}

    def __call__(self, model: str) -> dict:
        if model not in self._sections:
            session = f"corpus-{model}"
            candidates = [Candidate(bug, "tests.ports.paddle_job", steps, bug) for bug, steps in BUG_STEPS.items()]
            run_session(self.server.address, session, model, max(BUG_STEPS.values()), candidates)
            report = self.server.report_proto(session)
            self._sections[model] = {c.candidate_run: c for c in report.candidates}
            assert set(self._sections[model]) == set(BUG_STEPS), list(self._sections[model])
        return self._sections[model]

    def text(self, model: str) -> str:
        return render_text(self.server.report_proto(f"corpus-{model}"))


@pytest.fixture(scope="module")
def corpus(ports_server):
    return _Corpus(ports_server)


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_faithful_port_stays_aligned_for_50_steps(ports_server, model):
    session = f"faithful-{model}"
    run_pair(ports_server.address, session, model, steps=50)
    report = ports_server.report_proto(session)
    assert report.status == "aligned", f"{report.first_divergence}"
    assert report.steps_compared == 50
    # Fused projections are compared with their parts, not left unmatched.
    assert not [n for n in report.unmatched_baseline if "_proj" in n], list(report.unmatched_baseline)
    # Modules called by keyword (transformers' self_attn(hidden_states=...), paddleformers' decoder layers,
    # the models themselves) have their inputs captured (twinstep.wire.inputs.call_inputs) and
    # compared: an input is left unmatched only with its module's output (a module one side alone has).
    unmatched = {*report.unmatched_baseline, *report.unmatched_candidate}
    unpaired = [n for n in unmatched if n.startswith("input:") and "forward:" + n[len("input:"):] not in unmatched]
    assert not unpaired, unpaired
    compared = {row.name for row in ports_server.last_comparison(session).rows if row.phase == "input"}
    attention = {f"model.layers.{i}.self_attn" for i in range(models.LAYERS)}
    assert attention <= compared, sorted(compared)
    verdicts = "\n".join(report.long_run[0].verdicts)
    assert "FAIL" not in verdicts, verdicts


@pytest.mark.parametrize("model", models.MODEL_NAMES)
@pytest.mark.parametrize("bug", DETECTABLE)
def test_porting_bug_found_at_its_origin(corpus, model, bug):
    found = corpus(model)[bug]
    first = found.first_divergence
    step, phase, module, _ = models.EXPECTED_ORIGIN[bug][model]
    assert found.HasField("first_divergence"), f"not found: {found.status} {list(found.status_reasons)}"
    assert (first.step, first.phase) == (step, phase), first
    if phase == "forward":
        assert first.module == module, first
    else:
        # A learning rate or clipping bug moves every parameter: no module is its origin,
        # so the module is whichever parameter crosses first and the stage names the cause.
        assert GLOBAL_CAUSE[bug] in found.stage, found.stage


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_a_batch_fed_out_of_order_is_a_data_divergence(corpus, model):
    found = corpus(model)["batch_order"]
    first = found.first_divergence
    assert (first.step, first.phase, first.module) == (3, "forward", "model.embed_tokens")
    assert found.stage.startswith("data: step 3 differs from its very first module"), found.stage


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_a_wrong_custom_backward_is_found_in_backward(corpus, model):
    found = corpus(model)["custom_backward"]
    first = found.first_divergence
    assert (first.step, first.phase) == (0, "backward")
    # The activation's backward feeds the gate/up projection (fused in paddleformers; also in torch's Phi3).
    assert first.module in ("model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.{gate_proj,up_proj}"), first
    assert "act" in found.stage  # names the matching output gradient next to it


@pytest.mark.parametrize(("model", "step"), [("phi3", 0), ("ernie4_5", 0), ("gemma3", 1)])
def test_weight_decay_on_norms_is_traced_back_to_its_origin_without_a_reference(corpus, model, step):
    """1e-5 relative on norm weights per step: inside flat tolerances, traced back with no reference run
    (server/detect/origin.py).  Gemma's norm weights start at 0 (scale 1+w): decay first moves them at
    step 1, and its evidence is linear growth (declared at step 4, 6 steps run)."""
    found = corpus(model)["wd_on_norms"]
    first = found.first_divergence
    assert (first.step, first.phase, first.module) == (step, "param", models.EXPECTED_ORIGIN["wd_on_norms"][model][2]), first
    assert first.HasField("origin") and first.origin.involved_total >= 1, first
    assert "only 1-D parameters" in found.stage and "weight decay" in found.stage, found.stage
    assert "traced back to its origin" in corpus.text(model)


def test_weight_decay_on_norms_is_found_against_a_reference_band(ports_server):
    """The reference-band path (server/detect/noise.py) names the same origin, from the band instead."""
    run_pair(ports_server.address, "wd-ref", "ernie4_5", steps=2, bug="wd_on_norms", reference=True)
    report = ports_server.report_proto("wd-ref")
    first = report.first_divergence
    assert (first.step, first.phase, first.module) == (0, "param", models.EXPECTED_ORIGIN["wd_on_norms"]["ernie4_5"][2]), first
    assert not first.HasField("origin"), "found by the band, not traced back"
    assert "only 1-D parameters" in report.stage and "weight decay" in report.stage


def test_faithful_port_stays_aligned_against_a_deterministic_reference_band(ports_server):
    run_pair(ports_server.address, "ref", "ernie4_5", steps=20, reference=True)
    report = ports_server.report_proto("ref")
    assert report.status == "aligned", f"{report.first_divergence}"
    assert {r.name for r in report.runs} == {"torch", "paddle", "rerun"}


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_rotary_base_off_by_one_is_traced_to_rotary_emb_without_a_reference(corpus, model):
    """rope_base 10001: 2e-6..8e-6 on the rotary tables, under every flat tolerance; rotary_emb has no
    parameters and exact inputs, so its own error stands 15x over float32 rounding."""
    found = corpus(model)["rope_base"]
    first = found.first_divergence
    assert (first.step, first.phase, first.module) == (0, "forward", "model.rotary_emb"), first
    assert first.HasField("origin"), first
    assert "rotary base" in found.stage, found.stage


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_optimizer_epsilon_is_found_in_the_first_update_without_a_reference(corpus, model):
    # phi3 and ernie4_5: under every flat tolerance at step 0 (first crossed at step 1, in the forward or
    # backward), traced back by the matrices' mean error; gemma3 crosses a tolerance in the first update.
    found = corpus(model)["adam_eps"]
    first = found.first_divergence
    assert (first.step, first.phase) == (0, "param"), first
    assert first.HasField("origin") == (model != "gemma3"), first
    if first.HasField("origin"):
        assert first.HasField("crossed") and first.crossed.step == 1, first
    assert found.stage.startswith("optimizer:") and "epsilon" in found.stage, found.stage


def test_fused_projections_get_full_tensor_metrics(ports_server):
    """capture="tensors": paddle's qkv_proj (KV-head groups) and up_gate_proj ([gate | up]) are rebuilt
    from torch's parts, weights across layouts, and compared element by element."""
    from twinstep.server.compare.tolerance import ToleranceConfig

    run_pair(ports_server.address, "fused-tensors", "ernie4_5", steps=2, capture="tensors")
    report = ports_server.report_proto("fused-tensors")
    assert report.status == "aligned", f"{report.first_divergence}"
    last = ports_server.last_comparison("fused-tensors")
    assert last is not None and last.step == 1 and last.errors == []
    seen = set()
    for k, row in enumerate(last.rows):
        kind = next((f for f in ("qkv_proj", "up_gate_proj") if f".{f}" in row.candidate_name), None)
        if kind is None or row.phase == "input":  # inputs carry no tensors
            continue
        seen.add((row.phase, kind))
        rel_l2 = float(last.values["rel_l2"][k])
        limit = ToleranceConfig().for_record(row.phase, row.name, "float32")["rel_l2"]
        assert last.values["shape"][k] == 0.0, row
        # Computed (a float32 port is never bit-exact after a step), and far below tolerance:
        # a wrong chunk order or layout would give ~1.
        assert 0.0 < rel_l2 < limit / 10, (row.phase, row.name, rel_l2)
    assert seen == {(p, f) for p in ("forward", "backward", "grad", "param") for f in ("qkv_proj", "up_gate_proj")}


# ------------------------------------------------------------------ bugs that porting guides list
# Each sits in code all three models share (the training loop, the optimizer, the attention, a Linear), so one
# model runs them here; models.EXPECTED_ORIGIN holds all three (python -m tests.ports.paddle_origins), and
# benchmarks/localization.py runs every model.

GUIDE_MODEL = "phi3"
#: Steps each candidate trains: adam_betas first parts from the baseline in the update of step 1, and the
#: trace-back of an error under the tolerances needs the steps after it.
GUIDE_STEPS = {**dict.fromkeys(GUIDE, 2), "adam_betas": 4}


@pytest.fixture(scope="module")
def guide(ports_server):
    """One session: the torch baseline and one paddle candidate per bug of GUIDE."""
    session = f"guide-{GUIDE_MODEL}"
    candidates = [Candidate(bug, "tests.ports.paddle_job", steps, bug) for bug, steps in GUIDE_STEPS.items()]
    run_session(ports_server.address, session, GUIDE_MODEL, max(GUIDE_STEPS.values()), candidates)
    report = ports_server.report_proto(session)
    sections = {c.candidate_run: c for c in report.candidates}
    assert set(sections) == set(GUIDE), list(sections)
    return sections, check_words(report)


@pytest.mark.parametrize("bug", GUIDE)
def test_porting_guide_bug_found_at_its_origin(guide, bug):
    sections, checks = guide
    found = sections[bug]
    # Every sentence of its diagnosis that the checker knows is backed by the numbers beside it.
    assert all(c.holds for c in checks if c.section == f"candidate {bug}"), [c for c in checks if not c.holds]
    step, phase, module, _ = models.EXPECTED_ORIGIN[bug][GUIDE_MODEL]
    assert found.HasField("first_divergence"), f"not found: {found.status} {list(found.status_reasons)}"
    first = found.first_divergence
    assert (first.step, first.phase) == (step, phase), first
    if phase != "param":  # an optimizer bug moves many parameters: whichever crosses first is named
        assert first.module == module, first


def test_a_warmup_one_step_ahead_is_found_in_the_first_update(ports_server):
    """Both jobs warm the learning rate up over models.SCHEDULE_WARMUP steps; the candidate's scheduler was
    stepped once before training, so its first update runs at twice the baseline's rate."""
    run_pair(ports_server.address, "schedule", GUIDE_MODEL, steps=2, bug="lr_schedule", warmup=models.SCHEDULE_WARMUP)
    report = ports_server.report_proto("schedule")
    assert report.HasField("first_divergence"), f"not found: {report.status} {list(report.status_reasons)}"
    first = report.first_divergence
    assert (first.step, first.phase) == models.EXPECTED_ORIGIN["lr_schedule"][GUIDE_MODEL][:2], first


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_norm_epsilon_under_a_residual_stream_of_order_one(ports_server, model):
    """Embeddings at models.unit_embed_std: the residual stream is of order 1, as in trained models, and an
    RMSNorm epsilon of 1e-5 instead of 1e-6 moves the first norm's output by 4.5e-6 relative, under every
    flat tolerance. It is found there, at step 0, with no reference run; the faithful port trained from the
    same weights stays aligned for 50 steps."""
    session = f"unit-residual-{model}"
    candidates = [Candidate("faithful", "tests.ports.paddle_job", 50),
                  Candidate("norm_eps", "tests.ports.paddle_job", 2, "norm_eps")]
    run_session(ports_server.address, session, model, 50, candidates,
                baseline_args=("--embed-std", repr(models.unit_embed_std(model))))
    sections = {c.candidate_run: c for c in ports_server.report_proto(session).candidates}
    faithful, found = sections["faithful"], sections["norm_eps"]
    assert faithful.status == "aligned", f"{faithful.first_divergence}"
    assert found.HasField("first_divergence"), f"not found: {found.status} {list(found.status_reasons)}"
    first = found.first_divergence
    assert (first.step, first.phase, first.module) == models.EXPECTED_ORIGIN_UNIT_RESIDUAL["norm_eps"][model][:3], first
