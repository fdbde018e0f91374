"""Operations inside a module with real torch and paddle jobs: the functional operation a report names."""

from __future__ import annotations

import jsonschema

from tests.conftest import wait_for
from twinstep.cli.main import main as cli
from twinstep.server.report.render import render_text, report_schema


def test_a_bug_in_a_modules_inline_code_is_named_by_its_operation_and_line(server, jobs):
    # The paddle port divides layers.0.attn's scores by sqrt(head_dim + 1): no submodule differs, one
    # inline operation does.  The session (auto_ops, on by default) asks both runs for the operations of
    # the module whose own code the culprit points at, a few steps after the divergence.
    started = [
        jobs("torch", server=server.address, session="ops", baseline=True, steps=14,
             extra=["--step-delay", "0.05", "--lockstep", "2"]),
        jobs("paddle", server=server.address, session="ops", bug="attn_scale", steps=14,
             extra=["--step-delay", "0.05", "--lockstep", "2"]),
    ]
    results = [job.wait() for job in started]
    for result in results:
        assert result.returncode == 0 and not result.halted, result.output
    report = server.report_proto("ops")
    assert report.status == "diverged" and report.first_divergence.step == 0
    [window] = [w for w in report.zooms if w.origin == "auto-ops"]
    assert window.spec.ops_module == "layers.0.attn" and sorted(window.runs) == ["paddle", "torch"]
    [finding] = report.operations
    assert finding.status == "found", finding
    assert (finding.module, finding.candidate_module, finding.step) == ("layers.0.attn", "layers.0.attn",
                                                                           window.spec.first_step)
    # The divide, on the line of each model that scales the scores, and not the matmul before it.
    assert (finding.candidate.op, finding.baseline.op) == ("divide", "divide")
    assert finding.candidate.file.endswith("model_paddle.py") and "/ self.scale" in finding.candidate.code
    assert finding.baseline.file.endswith("model_torch.py") and "math.sqrt(self.head_dim)" in finding.baseline.code
    assert finding.value > finding.tolerance > 0 and finding.input_value < finding.value / 10
    assert finding.ops_matched >= 15  # torch's extra k.transpose is tolerated, every other operation paired
    text = render_text(report)
    assert "operations inside a module:" in text and "model_paddle.py:" in text and "divide" in text
    document = server.report("ops")
    jsonschema.validate(document, report_schema())
    assert document["operations"][0]["candidate"]["op"] == "divide"


def test_an_operators_ops_zoom_on_a_faithful_port_finds_every_operation_matching(server, jobs):
    started = [
        jobs("torch", server=server.address, session="faithful", baseline=True, steps=40,
             extra=["--step-delay", "0.05", "--lockstep", "2"]),
        jobs("paddle", server=server.address, session="faithful", steps=40,
             extra=["--step-delay", "0.05", "--lockstep", "2"]),
    ]
    wait_for(lambda: _compared(server, "faithful") >= 1, timeout=120)
    assert cli(["zoom", "faithful", "--ops", "layers.1", "--server", server.address]) == 0
    for job in started:
        result = job.wait()
        assert result.returncode == 0, result.output
    report = server.report_proto("faithful")
    assert report.status == "aligned"
    [window] = report.zooms
    assert window.origin == "operator" and window.spec.ops_module == "layers.1"
    [finding] = report.operations
    # The block's own code: its four children as one operation each, and the two residual adds.
    assert finding.status == "matched", finding.message
    assert finding.ops_baseline == finding.ops_candidate == finding.ops_matched == 6, finding


def _compared(server, session: str) -> int:
    try:
        return server.report_proto(session).steps_compared
    except KeyError:
        return 0
