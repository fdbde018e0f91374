"""Real ports: Hugging Face transformers (torch) vs paddleformers (paddle), real model code.

Each framework runs in its own process (tests/ports), random weights converted
from torch, identical data, AdamW, float32.  Needs tests/ports/install.sh
(part of the README's test command).
"""

from __future__ import annotations

import pytest

from tests.ports import models
from tests.ports.corpus import DETECTABLE, FUSED_MAPPING, run_pair
from twinstep.server import serve
from twinstep.server.config import config_from_dict


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
