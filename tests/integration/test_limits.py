"""Limits with clear errors, a memory budget that frees ended sessions, and runs that die named as lost."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from tests.integration.test_capture_health import Watcher
from twinstep.server.config import config_from_dict
from twinstep.v1 import twinstep_pb2 as pb

X = np.linspace(-1, 1, 4096)


def _join(address, session, run, baseline=False):
    stream = RawStream(address).send(hello(session, run, baseline=baseline)).send(manifest((0, "fc", "Linear")))
    first = stream.next()
    return stream, first


def _close(stream, last):
    stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=last)))
    stream.close()
    stream.wait_end()


@pytest.mark.parametrize("server", [{"config": config_from_dict({"limits": {"max_sessions": 2}})}], indirect=True)
def test_sessions_past_the_limit_are_refused_and_the_others_go_on(server):
    a, _ = _join(server.address, "one", "torch", baseline=True)
    b, _ = _join(server.address, "two", "torch", baseline=True)
    c = RawStream(server.address).send(hello("three", "torch", baseline=True))
    error = c.error()
    assert error.code().name == "RESOURCE_EXHAUSTED" and "max_sessions" in error.details()
    a.send(step(0, [(0, X)]))
    wait_for(lambda: server.report_proto("one").runs[0].last_step == 0)
    assert server.registry.names() == ["one", "two"]


@pytest.mark.parametrize("server", [{"config": config_from_dict({"limits": {"max_runs_per_session": 2}})}], indirect=True)
def test_runs_past_the_limit_are_refused(server):
    _join(server.address, "runs", "torch", baseline=True)
    _join(server.address, "runs", "paddle")
    third = RawStream(server.address).send(hello("runs", "mindspore"))
    error = third.error()
    assert error.code().name == "RESOURCE_EXHAUSTED" and "max_runs_per_session" in error.details()
    assert [r.name for r in server.report_proto("runs").runs] == ["torch", "paddle"]


@pytest.mark.parametrize("server", [{"config": config_from_dict({"memory": {"budget_bytes": 1000}})}], indirect=True)
def test_memory_budget_frees_ended_sessions_first_and_keeps_their_reports(server):
    ended, _ = _join(server.address, "ended", "torch", baseline=True)
    for number in range(20):  # a baseline alone: every step is held, waiting for a candidate
        ended.send(step(number, [(0, X)]))
    live, _ = _join(server.address, "live", "torch", baseline=True)
    for number in range(20):
        live.send(step(number, [(0, X)]))
    wait_for(lambda: server.report_proto("live").runs[0].last_step == 19)
    wait_for(lambda: server.report_proto("ended").runs[0].last_step == 19)
    held_live = server.registry.get("live").held_bytes()
    assert server.registry.get("ended").held_bytes() > 1000 and held_live > 0
    _close(ended, 19)
    wait_for(lambda: server.registry.get("ended").held_bytes() == 0)
    assert server.registry.get("live").held_bytes() == held_live  # a streaming session keeps its window
    report = server.report_proto("ended")  # and the freed one its report
    assert report.runs[0].last_step == 19 and report.status == "incomplete"


def test_a_run_that_dies_is_lost_with_how_long_it_was_silent_and_the_other_goes_on(server):
    watcher = Watcher(server.address, "dies")
    base, _ = _join(server.address, "dies", "torch", baseline=True)
    cand, _ = _join(server.address, "dies", "paddle")
    for number in range(3):
        base.send(step(number, [(0, X)]))
        cand.send(step(number, [(0, X)]))
    wait_for(lambda: server.report_proto("dies").steps_compared == 3)
    cand.channel.close()  # the process died: no Close
    wait_for(lambda: any("is lost after step 2" in line for line in watcher.lines))
    base.send(step(3, [(0, X)]))  # the baseline is not held back
    wait_for(lambda: server.report_proto("dies").runs[0].last_step == 3)
    report = server.report_proto("dies")
    assert {r.name: r.state for r in report.runs} == {"torch": "streaming", "paddle": "lost"}
    assert any("run 'paddle' lost its connection after step 2, " in r and "s after its last message" in r
               for r in report.status_reasons), report.status_reasons
    watcher.close()
