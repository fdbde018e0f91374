"""While the runs stream: what the server says must not read as final before it is, a zoom says whether it ran,
and informational lines stay informational, in twinstep's own words and format, in every process.

Real jobs (torch and paddle, separate processes) against an embedded server; raw gRPC streams where only the
order of messages matters.
"""

from __future__ import annotations

import logging
import re

import jsonschema
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.cli.main import main as cli
from twinstep.server import ServerConfig
from twinstep.server.config import DiagnosisConfig, SessionsConfig
from twinstep.server.report.render import render_text, report_schema
from twinstep.v1 import twinstep_pb2 as pb


def _server_lines(caplog, session: str) -> list[tuple[str, str]]:
    """(level, message) of every line the server logged about ``session``."""
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name.startswith("twinstep.server") and f"session {session}" in r.getMessage()]


def _steps_of(server, session: str) -> list[int]:
    """The last step of each run ([] while the session does not exist)."""
    try:
        return sorted(r.last_step for r in server.report_proto(session).runs)
    except KeyError:
        return []


def _settled(server, session: str, *unsettled: str) -> pb.Report:
    return wait_for(lambda: (r := server.report_proto(session)).status not in unsettled and r, timeout=60)


@pytest.mark.parametrize("server", [{"config": ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5),
                                                            diagnosis=DiagnosisConfig(auto_zoom=True))}],
                         indirect=True)
def test_a_candidate_that_ends_before_its_baseline_joins_is_waited_for_and_no_zoom_is_asked_of_it(server, jobs,
                                                                                                   caplog):
    caplog.set_level(logging.INFO, logger="twinstep.server")
    candidate = jobs("paddle", server=server.address, session="wait", bug="gelu_tanh", steps=6).wait()
    assert candidate.returncode == 0, candidate.output
    report = _settled(server, "wait", "running")
    waiting = ("waiting for the baseline to join (the 6 steps of candidate 'paddle' are kept for it); the verdict is "
               "told once it has run, and is final if no baseline joins within sessions.ttl (3600 s)")
    assert (report.status, list(report.status_reasons)) == ("waiting", [waiting])
    assert [(c.candidate_run, c.status, list(c.status_reasons)) for c in report.candidates] == [
        ("paddle", "waiting", [waiting])]
    assert f"session 'wait': WAITING\n" in render_text(report)
    lines = _server_lines(caplog, "wait")
    assert ("INFO", f"session wait: {waiting}") in lines, lines
    assert not [line for line in lines if line[0] != "INFO"], lines  # nothing final, nothing alarming yet
    assert not [line for line in lines if "INCOMPLETE" in line[1] or "every run has ended" in line[1]], lines

    baseline = jobs("torch", server=server.address, session="wait", baseline=True, steps=6).wait()
    assert baseline.returncode == 0, baseline.output
    report = _settled(server, "wait", "running", "waiting")
    assert report.status == "diverged" and report.first_divergence.module == "layers.1.mlp.act"
    # auto_zoom and auto_ops follow the divergence, but the candidate had ended: neither is asked of the
    # baseline alone (it would capture what nothing can be compared with), and the report says why.
    zooms = {w.origin: w for w in report.zooms}
    assert sorted(zooms) == ["auto", "auto-ops"], report.zooms
    why = ("not asked: run 'paddle' had ended (after step 5) before the divergence was declared, so no step of it "
           "could be captured")
    for window in zooms.values():
        assert (list(window.runs), window.state, list(window.captured)) == ([], why, []), window
    text = render_text(report) + "\n"
    auto = zooms["auto"]
    assert (f"  #{auto.spec.id} auto: layers.1.mlp.fc1, layers.1.mlp.act, layers.1.mlp.fc2, layers.1.mlp in tensors\n"
            f"     auto_zoom: divergence at step 0, forward of 'layers.1.mlp.act'\n     {why}\n") in text, text
    ops = zooms["auto-ops"]
    assert (f"  #{ops.spec.id} auto-ops: the operations of 'layers.1.mlp.act'\n"
            f"     auto_ops: divergence at step 0 in the code of 'layers.1.mlp.act'\n     {why}\n") in text, text
    assert "(model)" not in text.split("zoom (live capture changes):")[1]
    jsonschema.validate(server.report("wait"), report_schema())
    lines = _server_lines(caplog, "wait")
    told = [line for line in lines if "auto_zoom" in line[1] or "auto_ops" in line[1]]
    assert sorted(told) == sorted([
        ("INFO", f"session wait: auto_zoom #{auto.spec.id} after the divergence at step 0: {why}"),
        ("INFO", f"session wait: auto_ops #{ops.spec.id} after the divergence at step 0: {why}")]), told


@pytest.mark.parametrize("server", [{"config": ServerConfig(sessions=SessionsConfig(reconnect_grace=0.5, ttl=2.0))}],
                         indirect=True)
def test_a_verdict_waiting_for_a_baseline_becomes_final_once_none_can_join(server, caplog):
    caplog.set_level(logging.INFO, logger="twinstep.server")
    stream = RawStream(server.address).send(hello("alone", "paddle", framework="paddle")).send(
        manifest((0, "fc", "Linear")))
    assert stream.next().WhichOneof("body") == "welcome"
    for number in range(3):
        stream.send(step(number, [(0, [0.5, -0.5, 1.0])]))
    stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=2)))
    stream.close()
    stream.wait_end()
    assert _settled(server, "alone", "running").status == "waiting"
    wait_for(lambda: "alone" not in server.registry.names(), timeout=30)  # its time to live is over
    report = server.report_proto("alone")  # the report kept once it left memory
    assert report.status == "incomplete"
    missing = "no baseline run joined (attach one run with baseline=True)"
    assert list(report.status_reasons) == [missing]
    assert [(c.status, list(c.status_reasons)) for c in report.candidates] == [("incomplete", [missing])]
    final = [line for line in _server_lines(caplog, "alone") if "the verdict is final" in line[1]]
    assert final == [("WARNING", "session alone: no baseline joined within sessions.ttl (2 s): the verdict is final: "
                                 f"INCOMPLETE: {missing}")], final


def test_the_report_says_which_runs_ran_each_zoom_and_why_one_never_ran(server, jobs, caplog):
    caplog.set_level(logging.INFO, logger="twinstep.server")
    extra = ["--step-delay", "0.05", "--lockstep", "2"]
    started = [jobs("torch", server=server.address, session="ran", baseline=True, steps=40, extra=extra),
               jobs("paddle", server=server.address, session="ran", steps=40, extra=extra)]
    wait_for(lambda: len(steps := _steps_of(server, "ran")) == 2 and min(steps) >= 1, timeout=120)
    assert cli(["zoom", "ran", "--module", "layers.0.mlp.fc1", "--steps", "2", "--server", server.address]) == 0
    assert cli(["zoom", "ran", "--module", "layers.0.mlp.fc1", "--from-step", "1000", "--server",
                server.address]) == 0
    results = [job.wait() for job in started]
    for result in results:
        assert result.returncode == 0 and result.result["steps_completed"] == 40, result.output
    report = server.report_proto("ran")
    ran, never = report.zooms
    first = ran.spec.first_step
    assert sorted((c.run, c.first_step, c.last_step) for c in ran.captured) == [
        ("paddle", first, first + 1), ("torch", first, first + 1)]
    assert not never.captured and sorted(never.runs) == ["paddle", "torch"]
    text = render_text(report) + "\n"
    assert re.search(rf"  #1 operator: layers\.0\.mlp\.fc1 in tensors, steps {first}-{first + 1} "
                     rf"\(told: (torch, paddle|paddle, torch)\)\n     ran on torch and paddle, steps {first}-{first + 1}\n",
                     text), text
    assert re.search(r"  #2 operator: layers\.0\.mlp\.fc1 in tensors, step 1000 \(told: (torch, paddle|paddle, "
                     r"torch)\)\n     never ran: every run had ended before step 1000 \(torch after step 39, paddle "
                     r"after step 39\)\n", text), text
    jsonschema.validate(server.report("ran"), report_schema())

    # Each training says what it was asked, in words, once, as an informational line in twinstep's own format:
    # paddle installs a handler of its own on the root logger, which must not rewrite (or repeat) it.
    for result, run in zip(results, ("torch", "paddle")):
        lines = [line for line in result.output.splitlines() if "zoom #" in line]
        assert lines == [
            f"twinstep: run '{run}' rank 0: zoom #1 from the server: full tensors of layers.0.mlp.fc1 at steps "
            f"{first}-{first + 1}, asked by an operator",
            f"twinstep: run '{run}' rank 0: zoom #2 from the server: full tensors of layers.0.mlp.fc1 at step 1000, "
            "asked by an operator"], result.output
    zoom_lines = [line for line in _server_lines(caplog, "ran") if "zoom #" in line[1]]
    assert len(zoom_lines) == 2 and all(level == "INFO" for level, _ in zoom_lines), zoom_lines
