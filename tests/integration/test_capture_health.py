"""Capture that fails reaches the server: named in the report, the watch stream and the JSON, and the verdict says so.

Real torch and paddle jobs in their own processes, a real server over loopback.
The candidate's capture fails on purpose (tests/integration/jobs/faulty_capture.py);
its training goes on unharmed.
"""

from __future__ import annotations

import threading

import grpc
import jsonschema

from tests.conftest import wait_for
from twinstep.cli.main import format_event
from twinstep.server.report.render import render_text, report_schema
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

FAULTY = "tests.integration.jobs.faulty_capture"


class Watcher:
    """`twinstep watch` in a thread: the lines a user would see."""

    def __init__(self, address: str, session: str) -> None:
        self.lines: list[str] = []
        self._channel = grpc.insecure_channel(address)
        stream = pb_grpc.TwinstepStub(self._channel).Watch(pb.WatchRequest(session=session))
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        try:
            for event in stream:
                self.lines.append(format_event(event))
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._channel.close()
        self._thread.join(5)


def test_a_module_whose_output_cannot_be_read_is_named_and_the_session_ends_incomplete(server, jobs):
    watcher = Watcher(server.address, "spectral")
    base = jobs("torch", server=server.address, session="spectral", baseline=True, steps=4)
    cand = jobs("paddle", server=server.address, session="spectral", steps=4, module=FAULTY,
                extra=["--fault=spectrum"])
    base_result, cand_result = base.wait(), cand.wait()
    assert base_result.returncode == 0 and cand_result.returncode == 0, cand_result.output
    assert cand_result.result["steps_completed"] == 4  # the training never noticed
    # One warning in the training's log for the kind of failure, not one per step.
    assert cand_result.output.count("could not capture forward records") == 1, cand_result.output

    report = server.report_proto("spectral")
    assert report.status == "incomplete", report
    assert report.first_divergence.step == 0 and not report.HasField("first_divergence")
    assert report.steps_compared == 4  # everything else was compared, and matched
    reason, gap = report.status_reasons
    assert "run 'paddle'" in reason and "'spectrum'" in reason and "complex64" in reason, reason
    # Which steps lack it: every step, forward phase only.
    assert gap.startswith("run 'paddle': not compared: steps 0 to 3 (forward only) (run 'paddle': some records"), gap
    paddle_run = next(r for r in report.runs if r.name == "paddle")
    (health,) = paddle_run.health
    (failure,) = health.capture.failures
    assert (failure.phase, failure.name, failure.count) == (pb.FORWARD, "spectrum", 4)
    assert (failure.first_step, failure.last_step) == (0, 3)
    assert failure.error.startswith("UnsupportedTensor: ")
    assert "incomplete" in render_text(report).lower() and "'spectrum'" in render_text(report)

    document = server.report("spectral")
    jsonschema.validate(document, report_schema())
    runs = {r["name"]: r for r in document["runs"]}
    assert runs["paddle"]["capture_health"][0]["failures"][0]["name"] == "spectrum"
    assert runs["torch"]["capture_health"] == []

    # The watch stream named it as it happened, once, and told the verdict when the runs ended.
    wait_for(lambda: any("every run has ended" in line for line in watcher.lines))
    watcher.close()
    alerts = [line for line in watcher.lines
              if "WARNING" in line and "'spectrum'" in line and "every run has ended" not in line]
    assert len(alerts) == 1 and "run 'paddle'" in alerts[0], watcher.lines
    assert any("capture-failures" in line for line in watcher.lines)
    assert any("INCOMPLETE" in line for line in watcher.lines if "every run has ended" in line)


def test_a_run_whose_every_statistic_fails_delivers_nothing_and_says_why(server, jobs):
    base = jobs("torch", server=server.address, session="nostats", baseline=True, steps=3)
    cand = jobs("paddle", server=server.address, session="nostats", steps=3, module=FAULTY,
                extra=["--fault=stats-until=1000"])
    assert base.wait().returncode == 0
    cand_result = cand.wait()
    assert cand_result.returncode == 0 and cand_result.result["steps_completed"] == 3
    assert cand_result.output.count("could not record step") == 1, cand_result.output
    report = server.report_proto("nostats")
    assert report.status == "incomplete" and report.steps_compared == 0
    text = "\n".join(report.status_reasons)
    assert "run 'paddle' delivered no step" in text and "vecdot" in text, text
    assert "no step was compared" in text
    jsonschema.validate(server.report("nostats"), report_schema())


def test_faithful_pair_is_aligned_with_no_reasons_and_valid_json(server, jobs):
    base = jobs("torch", server=server.address, session="clean", baseline=True, steps=3)
    cand = jobs("paddle", server=server.address, session="clean", steps=3)
    assert base.wait().returncode == 0 and cand.wait().returncode == 0
    document = server.report("clean")
    jsonschema.validate(document, report_schema())
    assert document["status"] == "aligned" and document["status_reasons"] == []
    runs = {r["name"]: r for r in document["runs"]}
    assert runs["torch"]["environment"]["numpy"] and runs["paddle"]["environment"]["numpy"]
    assert runs["paddle"]["environment"]["paddle"] and runs["torch"]["environment"]["torch"]
    assert document["tree"]["rows"] and document["schema_version"].startswith("1.")
