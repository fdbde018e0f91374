"""A session whose runs have all ended is never left `running`: aligned, diverged, or incomplete with its reasons."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.server import ServerConfig
from twinstep.server.config import SessionsConfig
from twinstep.v1 import twinstep_pb2 as pb

VALUES = np.linspace(-1, 1, 16)


def run_stream(address: str, session: str, run: str, steps: range | list[int], *, baseline: bool = False,
               close: bool = True, health: pb.CaptureHealth | None = None) -> RawStream:
    stream = RawStream(address).send(hello(session, run, baseline=baseline)).send(manifest((0, "fc", "Linear")))
    assert stream.next().WhichOneof("body") == "welcome"
    if health is not None:
        stream.send(pb.ClientMessage(health=health))
    for number in steps:
        stream.send(step(number, [(0, VALUES)]))
    if close:
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=list(steps)[-1] if steps else -1)))
        stream.close()
        stream.wait_end()
    return stream


def ended(server, session: str):
    """The report once the server knows every run ended (it reads a goodbye after the client sent it)."""
    wait_for(lambda: all(r.state != "streaming" for r in server.report_proto(session).runs))
    return server.report_proto(session)


def verdicts_told(events, count: int) -> list[str]:
    """The "every run has ended" alerts, once there are ``count``: the server tells one just after it marks
    the last run ended, so a test that read them at once could look before it was told."""
    def told() -> list[str] | None:
        found = [e.alert.message for e in events.history if "every run has ended" in e.alert.message]
        return found if len(found) >= count else None
    return wait_for(told)


def test_baseline_alone_waits_for_a_candidate_not_running_nor_judged(server):
    run_stream(server.address, "alone", "torch", range(3), baseline=True)
    report = ended(server, "alone")
    assert report.status == "waiting"
    assert list(report.status_reasons) == [
        "waiting for a candidate to join (the 3 steps of baseline 'torch' are kept for it); the verdict is told once "
        "one has run, and is final if no candidate joins within sessions.ttl (3600 s)"]


def test_a_candidate_that_joins_after_the_baseline_ended_is_still_compared_and_the_verdict_told_again(server):
    """A baseline started (and finished) first is not a lost session: the server says so, then compares the late one."""
    events = server.registry.get_or_create("late").events
    run_stream(server.address, "late", "torch", range(3), baseline=True)
    ended(server, "late")
    waiting = wait_for(lambda: [e.alert for e in events.history if "waiting for a candidate" in e.alert.message])
    assert [(a.level, a.message) for a in waiting] == [("info", (
        "waiting for a candidate to join (the 3 steps of baseline 'torch' are kept for it); the verdict is told once "
        "one has run, and is final if no candidate joins within sessions.ttl (3600 s)"))]
    run_stream(server.address, "late", "paddle", range(3))
    report = ended(server, "late")
    assert report.status == "aligned" and report.steps_compared == 3, (report.status, report.status_reasons)
    told = verdicts_told(events, 1)
    assert told == ["every run has ended: aligned over 3 compared step(s)"], told  # the first and only verdict


def test_candidate_that_ends_early_leaves_the_rest_uncompared(server):
    run_stream(server.address, "early", "torch", range(6), baseline=True)
    run_stream(server.address, "early", "paddle", range(3))
    report = ended(server, "early")
    assert report.status == "incomplete" and report.steps_compared == 3
    assert list(report.status_reasons) == ["run 'paddle': not compared: steps 3 to 5 (run 'paddle' ended at step 2)"]
    (coverage,) = report.coverage
    assert [(r.first, r.last) for r in coverage.compared] == [(0, 2)]
    assert coverage.summary == ("compared steps 0 to 2 (3 step(s)); not compared: steps 3 to 5 "
                                "(run 'paddle' ended at step 2)")


def test_a_lost_run_is_named(server):
    run_stream(server.address, "lost", "torch", range(3), baseline=True)
    stream = run_stream(server.address, "lost", "paddle", range(3), close=False)
    wait_for(lambda: server.report_proto("lost").steps_compared == 3)
    stream.channel.close()  # the process died: no Close
    ended(server, "lost")  # lost at once; the verdict waits for its reconnect grace (0.5 s in these tests)
    report = wait_for(lambda: (r := server.report_proto("lost")).status != "running" and r)
    assert report.status == "incomplete"
    assert any("run 'paddle' lost its connection after step 2" in r for r in report.status_reasons)


def test_matching_runs_end_aligned_with_no_reasons(server):
    run_stream(server.address, "ok", "torch", range(3), baseline=True)
    run_stream(server.address, "ok", "paddle", range(3))
    report = ended(server, "ok")
    assert (report.status, list(report.status_reasons)) == ("aligned", [])


def test_capture_health_is_kept_per_rank_and_bounded(server):
    health = pb.CaptureHealth(failures=[pb.CaptureFailure(phase=pb.GRAD, name="w", count=3, first_step=0,
                                                          last_step=2, error="ValueError: nope")])
    run_stream(server.address, "health", "torch", range(3), baseline=True)
    run_stream(server.address, "health", "paddle", range(3), health=health)
    report = ended(server, "health")
    assert report.status == "incomplete"
    assert any("3 record(s) of 1 parameter not captured (grad 3; 'w'; steps 0 to 2): ValueError: nope" in r
               for r in report.status_reasons), report.status_reasons
    # A health message past the bound is refused with a clear status; the session keeps its data.
    flood = pb.CaptureHealth(failures=[pb.CaptureFailure(name=str(i)) for i in range(5000)])
    stream = RawStream(server.address).send(hello("health", "paddle")).send(pb.ClientMessage(health=flood))
    error = stream.error()
    assert error.code().name == "INVALID_ARGUMENT" and "at most 1024" in error.details()
    assert server.report_proto("health").steps_compared == 3


@pytest.mark.parametrize("reason, words", [("queue_full", "the send queue was full"), ("sender_lost", "sender process")])
def test_client_drops_are_named_with_their_steps_and_reason(server, reason, words):
    session = f"drops-{reason}"
    run_stream(server.address, session, "torch", range(4), baseline=True)
    health = pb.CaptureHealth(dropped={reason: 2}, missing=[pb.MissingSteps(first_step=1, last_step=2, reason=reason)])
    run_stream(server.address, session, "paddle", [0, 3], health=health)
    report = ended(server, session)
    assert report.status == "incomplete" and report.steps_compared == 2
    paddle_run = next(r for r in report.runs if r.name == "paddle")
    assert dict(paddle_run.dropped_by_reason) == {reason: 2}
    (reason_text,) = report.status_reasons
    assert reason_text.startswith("run 'paddle': not compared: steps 1 to 2 (run 'paddle': ") and words in reason_text
    (gap,) = report.coverage[0].gaps
    assert (gap.run, gap.first_step, gap.last_step) == ("paddle", 1, 2) and words in gap.reason


@pytest.mark.parametrize("server", [{"config": ServerConfig(sessions=SessionsConfig(reconnect_grace=30.0))}], indirect=True)
def test_a_run_that_reconnects_within_its_grace_is_compared_as_if_it_never_left(server):
    """The candidate's stream breaks while the baseline holds steps it has not matched; it reconnects, is
    told what the server holds, and sends the rest: every step is compared, nothing is 'unmatched'."""
    base = run_stream(server.address, "blip", "torch", range(5), baseline=True, close=False)
    cand = run_stream(server.address, "blip", "paddle", range(2), close=False)
    wait_for(lambda: server.report_proto("blip").steps_compared == 2 and last_of(server, "blip", "torch") == 4)
    cand.channel.close()  # the link broke: no Close
    wait_for(lambda: run_of(server, "blip", "paddle").state == "lost")
    assert server.report_proto("blip").status == "running"  # within its grace: no verdict yet
    again = RawStream(server.address).send(hello("blip", "paddle")).send(manifest((0, "fc", "Linear")))
    assert again.next().welcome.last_step_received == 1
    for number in range(2, 5):
        again.send(step(number, [(0, VALUES)]))
    for stream, last in ((again, 4), (base, 4)):
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=last)))
        stream.close()
        stream.wait_end()
    report = wait_for(lambda: (r := server.report_proto("blip")).status != "running" and r)
    assert (report.status, report.steps_compared) == ("aligned", 5), list(report.status_reasons)
    assert all(not r.dropped_by_reason for r in report.runs), [dict(r.dropped_by_reason) for r in report.runs]


def run_of(server, session: str, run: str) -> pb.RunStatus:
    return next(r for r in server.report_proto(session).runs if r.name == run)


def last_of(server, session: str, run: str) -> int:
    return run_of(server, session, run).last_step
