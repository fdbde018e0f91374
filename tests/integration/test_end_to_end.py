"""A torch baseline and a paddle port, each a real process, streaming to a real server."""

from __future__ import annotations

import pytest



def run_pair(jobs, server, session: str, *, bug: str | None = None, steps: int = 20, capture: str = "stats",
             extra: list[str] | None = None):
    base = jobs("torch", server=server.address, session=session, baseline=True, steps=steps, capture=capture, extra=extra)
    cand = jobs("paddle", server=server.address, session=session, bug=bug, steps=steps, capture=capture, extra=extra)
    return base.wait(), cand.wait()


def test_faithful_port_stays_aligned_for_20_steps(server, jobs):
    base, cand = run_pair(jobs, server, "faithful")
    assert base.returncode == 0 and cand.returncode == 0, base.output + cand.output
    report = server.report("faithful")
    assert report["status"] == "aligned", report
    assert report["first_divergence"] is None
    assert report["steps_compared"] == 20
    assert {r["name"]: r["state"] for r in report["runs"]} == {"torch": "finished", "paddle": "finished"}
    assert all(r["last_step"] == 19 and r["dropped"] == 0 for r in report["runs"])
    assert not base.halted and not cand.halted
    for run in report["runs"]:  # what capture read, as each job counted it, summed by the server
        cost = run["capture_cost"]
        assert cost["steps"] == 20
        # Each distinct tensor once: a block's input is the previous block's output, and so on.
        assert 0 < cost["bytes_read"] < cost["bytes_captured"]
        assert cost["stats_offloaded"] > 0 and cost["stats_inline"] > 0


def test_gelu_tanh_bug_found_at_step0_forward_of_the_activation(server, jobs):
    base, cand = run_pair(jobs, server, "gelu", bug="gelu_tanh", steps=5)
    assert base.returncode == 0 and cand.returncode == 0
    first = server.report("gelu")["first_divergence"]
    assert first is not None
    assert (first["step"], first["phase"], first["module"], first["rank"]) == (0, "forward", "layers.1.mlp.act", 0)
    assert first["candidate_module"] == "layers.1.mlp.act"
    assert first["value"] > first["tolerance"]


def test_learning_rate_bug_found_at_step0_in_parameters(server, jobs):
    base, cand = run_pair(jobs, server, "lr", bug="lr", steps=3)
    assert base.returncode == 0 and cand.returncode == 0, base.output + cand.output
    first = server.report("lr")["first_divergence"]
    # Forward, loss, backward and gradients of step 0 all matched: the first
    # divergence is the parameters after the first optimizer update.
    assert (first["step"], first["phase"]) == (0, "param"), first


def test_tensor_mode_aligned_and_finds_the_bug(server, jobs):
    base, cand = run_pair(jobs, server, "tensors-ok", capture="tensors", steps=5)
    assert server.report("tensors-ok")["status"] == "aligned"
    base, cand = run_pair(jobs, server, "tensors-bug", capture="tensors", bug="gelu_tanh", steps=3)
    first = server.report("tensors-bug")["first_divergence"]
    assert (first["step"], first["phase"], first["module"]) == (0, "forward", "layers.1.mlp.act")


@pytest.mark.parametrize("server", [{"halt_on_divergence": True}], indirect=True)
def test_halt_reaches_both_jobs(server, jobs):
    base, cand = run_pair(jobs, server, "halt", bug="gelu_tanh", steps=200, extra=["--lockstep", "1"])
    assert base.returncode == 0 and cand.returncode == 0
    assert base.halted and cand.halted, base.output + cand.output
    assert "layers.1.mlp.act" in base.result["halt_reason"]
    # Lockstep 1: neither job got far past the divergence at step 0.
    assert base.result["steps_completed"] <= 3 and cand.result["steps_completed"] <= 3
    report = server.report("halt")
    assert report["halted"] is True and report["status"] == "diverged"
    assert {r["state"] for r in report["runs"]} == {"halted"}


def test_lossy_tensors_keep_every_verdict(server, jobs):
    """capture="lossy": tensors quantised within the server's budget; same verdicts as lossless."""
    run_pair(jobs, server, "lossy-ok", capture="lossy", steps=5)
    report = server.report_proto("lossy-ok")
    assert report.status == "aligned" and not report.errors, report
    # Element-wise metrics were computed from the lossy payloads (rel_l2 > 0 somewhere).
    assert any(h.metric == "rel_l2" and 0 < h.value < h.tolerance for h in report.headroom)
    run_pair(jobs, server, "lossy-bug", capture="lossy", bug="gelu_tanh", steps=3)
    first = server.report("lossy-bug")["first_divergence"]
    assert (first["step"], first["phase"], first["module"]) == (0, "forward", "layers.1.mlp.act")


def test_sketches_compared_without_false_alarms_and_bug_still_found(server, jobs):
    run_pair(jobs, server, "sketch-ok", steps=10, extra=["--sketch"])
    report = server.report_proto("sketch-ok")
    assert report.status == "aligned" and not report.errors, report
    run_pair(jobs, server, "sketch-bug", bug="gelu_tanh", steps=3, extra=["--sketch"])
    report = server.report_proto("sketch-bug")
    assert (report.first_divergence.step, report.first_divergence.module) == (0, "layers.1.mlp.act")
    # The activation's fingerprint sees the bug too: its sketch estimate is over tolerance.
    act = server.last_comparison("sketch-bug")
    rows = [k for k, r in enumerate(act.rows) if r.phase == "forward" and r.name == "layers.1.mlp.act"]
    assert rows and act.values["sketch_rel_l2"][rows[0]] > act.tolerance["sketch_rel_l2"][rows[0]]
