"""Real ports: Hugging Face transformers (torch) vs paddleformers (paddle), real model code.

Each framework runs in its own process (tests/ports), random weights converted
from torch, identical data, AdamW, float32.  Needs transformers and paddleformers
(the `latest` and `paddleformers` test legs install them; tests/envs).
"""

from __future__ import annotations

import pytest

from tests.ports import models
from tests.ports.corpus import DETECTABLE, FUSED_MAPPING, run_pair
from twinstep.server import serve
from twinstep.server.config import config_from_dict


#: Bugs of the corpus that touch every parameter, and the words the stage must name them by.
GLOBAL_CAUSE = {"lr": "learning rate", "grad_clip": "clipping"}


@pytest.fixture
def ports_server():
    handle = serve(port=0, config=config_from_dict({"mapping": FUSED_MAPPING}))
    yield handle
    handle.stop(grace=0.5)


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_faithful_port_stays_aligned_for_50_steps(ports_server, model):
    run_pair(ports_server.address, "faithful", model, steps=50)
    report = ports_server.report_proto("faithful")
    assert report.status == "aligned", f"{report.first_divergence}"
    assert report.steps_compared == 50
    # Fused projections are compared with their parts, not left unmatched.
    assert not [n for n in report.unmatched_baseline if "_proj" in n], list(report.unmatched_baseline)
    verdicts = "\n".join(report.long_run[0].verdicts)
    assert "FAIL" not in verdicts, verdicts


@pytest.mark.parametrize("model", models.MODEL_NAMES)
@pytest.mark.parametrize("bug", DETECTABLE)
def test_porting_bug_found_at_its_origin(ports_server, model, bug):
    run_pair(ports_server.address, "bug", model, steps=2, bug=bug)
    first = ports_server.report("bug")["first_divergence"]
    step, phase, module, _ = models.EXPECTED_ORIGIN[bug][model]
    assert first is not None, "not found"
    assert (first["step"], first["phase"]) == (step, phase), first
    if phase == "forward":
        assert first["module"] == module, first
    else:
        # A learning rate or clipping bug moves every parameter: no module is its origin,
        # so the module is whichever parameter crosses first and the stage names the cause.
        assert GLOBAL_CAUSE[bug] in ports_server.report_proto("bug").stage


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_a_batch_fed_out_of_order_is_a_data_divergence(ports_server, model):
    run_pair(ports_server.address, "data", model, steps=5, bug="batch_order")
    report = ports_server.report_proto("data")
    first = report.first_divergence
    assert (first.step, first.phase, first.module) == (3, "forward", "model.embed_tokens")
    assert report.stage.startswith("data: step 3 differs from its very first module")


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_a_wrong_custom_backward_is_found_in_backward(ports_server, model):
    run_pair(ports_server.address, "backward", model, steps=2, bug="custom_backward")
    report = ports_server.report_proto("backward")
    first = report.first_divergence
    assert (first.step, first.phase) == (0, "backward")
    # The activation's backward feeds the gate/up projection (fused in paddleformers; also in torch's Phi3).
    assert first.module in ("model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.{gate_proj,up_proj}"), first
    assert "act" in report.stage  # names the matching output gradient next to it


@pytest.mark.parametrize(("model", "step"), [("phi3", 0), ("ernie4_5", 0), ("gemma3", 1)])
def test_weight_decay_on_norms_needs_the_baselines_own_noise_band(ports_server, model, step):
    """1e-5 relative on norm weights: inside flat tolerances, far outside a reference rerun's band.

    Gemma's norm weights start at 0 (scale 1+w): decay first moves them at step 1.
    """
    run_pair(ports_server.address, "wd", model, steps=3, bug="wd_on_norms", reference=True)
    report = ports_server.report_proto("wd")
    first = report.first_divergence
    assert (first.step, first.phase, first.module) == (step, "param", models.EXPECTED_ORIGIN["wd_on_norms"][model][2]), first
    assert "only 1-D parameters" in report.stage and "weight decay" in report.stage


def test_faithful_port_stays_aligned_against_a_deterministic_reference_band(ports_server):
    run_pair(ports_server.address, "ref", "ernie4_5", steps=20, reference=True)
    report = ports_server.report_proto("ref")
    assert report.status == "aligned", f"{report.first_divergence}"
    assert {r.name for r in report.runs} == {"torch", "paddle", "rerun"}


@pytest.mark.parametrize("model", models.MODEL_NAMES)
def test_rotary_base_off_by_one_is_found_with_a_reference_band(ports_server, model):
    """rope_base 10001: 2e-6 on the rotary tables, under every flat tolerance, over a reference band."""
    run_pair(ports_server.address, "rope", model, steps=2, bug="rope_base", reference=True)
    first = ports_server.report("rope")["first_divergence"]
    assert (first["step"], first["phase"], first["module"]) == (0, "forward", "model.rotary_emb"), first


@pytest.mark.parametrize(("model", "capture"), [("phi3", "tensors"), ("ernie4_5", "stats"), ("gemma3", "stats")])
def test_optimizer_epsilon_is_found_in_the_first_update_with_a_reference_band(ports_server, model, capture):
    # phi3's first update differs by 2.2e-5 on embed_tokens in full tensors only: its statistics
    # see it one step later, in the forward.  Full tensors (rel_l2 against the band) find the origin.
    run_pair(ports_server.address, "eps", model, steps=2, bug="adam_eps", reference=True, capture=capture)
    report = ports_server.report_proto("eps")
    first = report.first_divergence
    assert (first.step, first.phase) == (0, "param"), first
    assert report.stage.startswith("optimizer:") and "epsilon" in report.stage, report.stage


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
